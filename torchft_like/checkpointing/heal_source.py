"""A heal source as a value, parsed once from the metadata it advertises, and
the one rule for healing from one source or several.

Checkpoint metadata travels between replicas as a string, and that wire form
stays as it is: pytorch/torchft peers send and read it too. Ours is
``http://host:port/torchft_like/checkpoint/`` (a torchft receiver appends
``{step}/full`` to it), torchft's ``http://host:port/checkpoint/``. A
receiving transport parses each source's string here, once, at its edge;
everything below it (the one-stream fetch, torchft's fetch, the striped
fetch, the messages) reads the `HealSource`'s parts instead of parsing the
string again.

One source or several is decided in two halves, both here, because they
are known at two moments:

- `stripe_cap`, before any metadata: how many up-to-date peers a healer may
  take. It feeds the quorum's transfer plan (manager.heal_plan.transfer_plan), which
  both ends of a heal must read alike: whom a healer asks, whom a source
  serves.
- `heal_fetch`, once the sources' metadata is in: the plan's sources that
  answered, fetched striped, or the first of them alone.

Pure: no sockets, no torch (tests/unit/test_heal_source.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

TORCHFT_PATH = "/checkpoint/"
"""The path of a torchft HTTPTransport's metadata."""
OWN_PATH = "/torchft_like/checkpoint/"
"""The path of ours: torchft receivers append ``{step}/full`` to it."""
KEY = "full"
"""The one key of torchft's URL scheme that we serve and fetch."""
SCHEMES = ("http", "https")


class BadMetadata(ValueError):
    """A peer's checkpoint metadata that names no checkpoint server to fetch from."""


@dataclass(frozen=True)
class HealSource:
    """One peer a healing rank fetches a step's state from.

    Build it with `parse`; the fields are what the fetching layers ask of a
    source: where to connect, in which format, and how to name it.
    """

    replica_rank: int
    metadata: str
    """The wire form, as the peer advertised it (what messages show)."""
    scheme: str
    """"http" or "https"."""
    host: str
    """Without the brackets of an IPv6 literal: what a socket connects to."""
    port: int
    torchft: bool
    """A pytorch/torchft peer: one stream, in torch's format, decoded
    weights_only; no ranges, so it is never striped."""

    @classmethod
    def parse(cls, replica_rank: int, metadata: str) -> HealSource:
        """`metadata`, a peer's `CheckpointTransport.metadata()`, as a value.

        Accepted: ``http(s)://host:port`` with the path of our transport
        (``/torchft_like/checkpoint/``, or none) or torchft's
        (``/checkpoint/``). The scheme is not checked against this process's
        TLS here; the transport does that.

        Raises:
            BadMetadata: (a ValueError) what is wrong with it, and what is accepted.
        """

        def bad(why: str) -> BadMetadata:
            return BadMetadata(
                f"checkpoint metadata {metadata!r} of replica rank {replica_rank} {why}; "
                f"a checkpoint server's is http(s)://host:port{OWN_PATH} (torchft_like) "
                f"or http(s)://host:port{TORCHFT_PATH} (torchft)"
            )

        try:
            url = urlsplit(metadata)
            port = url.port
        except ValueError as e:  # an unclosed IPv6 bracket, a port not a number or past 65535
            raise bad(f"does not parse: {e}") from None
        if url.scheme not in SCHEMES:
            raise bad(f"has scheme {url.scheme!r}" if url.scheme else "has no scheme")
        if not url.hostname:
            raise bad("names no host")
        if not port:
            raise bad("names no port" if port is None else "has port 0")
        if url.username is not None or url.query or url.fragment:
            raise bad("carries a user, a query or a fragment, which no checkpoint server sends")
        if url.path not in ("", "/", OWN_PATH, TORCHFT_PATH):
            raise bad(f"has path {url.path!r}")
        return cls(
            replica_rank=replica_rank,
            metadata=metadata,
            scheme=url.scheme,
            host=url.hostname,
            port=port,
            torchft=url.path == TORCHFT_PATH,
        )

    @property
    def base_url(self) -> str:
        """``scheme://host:port``, brackets around an IPv6 host."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def label(self) -> str:
        """How messages and stripe reports name this source."""
        kind = "torchft replica rank" if self.torchft else "replica rank"
        return f"{kind} {self.replica_rank} at {self.metadata}"

    def state_path(self, step: int) -> str:
        """The request path of `step`'s whole state: torchft's
        ``/checkpoint/{step}/full`` (what its receiver appends to its
        metadata), or ours, ``/checkpoint/{step}``."""
        if self.torchft:
            return f"{TORCHFT_PATH}{step}/{KEY}"
        return f"/checkpoint/{step}"

    def state_url(self, step: int) -> str:
        """`state_path` as a URL, for messages."""
        return self.base_url + self.state_path(step)


def stripe_cap(can_stripe: bool, heal_sources: int | None) -> int | None:
    """How many up-to-date peers a healer may fetch from at once (None:
    all): the Manager's `heal_sources` where the transport can stripe, else 1.

    A push transport (PGTransport) cannot stripe: with 1 the plan has each
    source send to exactly the healers whose primary it is, so no send
    waits on a receiver that never comes.
    """
    return heal_sources if can_stripe else 1


@dataclass(frozen=True)
class HealFetch:
    """What a healing rank fetches from: one source, or several striped."""

    sources: tuple[HealSource, ...]
    """The primary (or the first that answered) first; never empty."""

    @property
    def striped(self) -> bool:
        """Several sources, each sending a distinct byte range. The
        healer's collectives then wait for the whole transfer: a source
        serves one range at a time, so having begun does not hold it to the
        end as one stream does."""
        return len(self.sources) > 1

    @property
    def first(self) -> HealSource:
        """The one source of an unstriped fetch."""
        return self.sources[0]


def heal_fetch(sources: Sequence[HealSource]) -> HealFetch:
    """One source or several, from the plan's sources that answered (in
    the plan's order, the primary first).

    - Sources with the same metadata are one server: the first rank stands for it.
    - A torchft peer among them: the first alone, since torchft's format has
      no ranges to stripe and a job mixing both kinds heals as torchft does.
    - One distinct server: it alone. Otherwise all, striped.

    Raises:
        ValueError: `sources` is empty.
    """
    if not sources:
        raise ValueError("a heal needs at least one source")
    distinct: dict[str, HealSource] = {}
    for source in sources:
        distinct.setdefault(source.metadata, source)
    if len(distinct) == 1 or any(s.torchft for s in sources):
        return HealFetch((sources[0],))
    return HealFetch(tuple(distinct.values()))
