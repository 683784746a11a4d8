"""Healing from several peers at once: one step's state, striped by byte range.

Replicas at the quorum's max step hold the same state bit for bit, so a
receiver can take a distinct byte range of it from each of them at once
and is no longer bound by one sender's link. The state's tensor bytes are
cut into ``num_sources * ranges_per_source`` equal ranges (the chunk
ranges the server already serves, ``?chunk=i&of=n``); range i is at home
on source ``i mod num_sources``. Every source works through its own ranges
first and then takes over ranges still pending elsewhere, so a slow link
ends up serving less. A source that fails (refused, reset, stalled past the
stall timeout, a checksum mismatch) is dropped for the rest of the fetch and
its unfinished range goes back to be fetched whole from a remaining one.

Every range is checked against the checksums its source sent before it
counts as done; every source's layout header must describe the same state
(the same tree, dtypes, shapes and checksum algorithm; devices may differ
by index), or the fetch is refused, since mixing ranges of two different
states would build a state that neither peer holds.
"""

from __future__ import annotations

import http.client
import logging
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchft_like.checkpointing import checksum, staging, state_format
from torchft_like.checkpointing.heal_source import HealSource
from torchft_like.checkpointing.http_fetch import (
    ChecksumMismatch,
    Fetch,
    NotReady,
    Prefaulter,
    Refused,
    hang_up,
    pieces,
)

logger = logging.getLogger(__name__)

_RETRY_S = 0.05
"""How long a source that does not serve the step yet waits before asking again."""
MAX_RANGES = 256
"""The server's bound on `of` in ``?chunk=i&of=n``."""


class LayoutMismatch(ValueError):
    """Two sources describe different states: striping them would mix them."""


class Stripes:
    """Which byte range each source fetches next; bookkeeping only, thread-safe.

    Ranges are numbered 0..num_ranges-1 and range r is at home on source
    ``r % num_sources``. `take` gives a source its own lowest pending range,
    else a pending range whose home source died, else the highest pending
    range of another live source (taken from the end, so the owner keeps
    reading in order). A failed source is dead for the rest of the fetch and
    its range goes back to pending.
    """

    def __init__(self, num_ranges: int, num_sources: int) -> None:
        if num_sources < 1 or num_ranges < num_sources:
            raise ValueError(
                f"need at least one source and a range per source, got {num_ranges} ranges "
                f"for {num_sources} sources"
            )
        self.num_ranges, self.num_sources = num_ranges, num_sources
        self._cond = threading.Condition()
        self._pending = list(range(num_ranges))
        self._in_flight: dict[int, int] = {}
        self._done: dict[int, int] = {}
        """range -> the source that delivered it"""
        self.errors: dict[int, BaseException] = {}
        """source -> why it was dropped"""
        self.refetched = 0
        """Ranges given back by a failed source."""

    def home(self, r: int) -> int:
        return r % self.num_sources

    def take(self, source: int, timeout: float = 0.0) -> int | None:
        """The next range for `source` to fetch, or None when there is none
        for it: all are done or in flight elsewhere at `timeout`, `source`
        is dead, or every source is. Waits up to `timeout` seconds while
        nothing is pending but ranges are in flight (one may come back)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if source in self.errors or self.failed():
                    return None
                r = self._pick(source)
                if r is not None:
                    self._pending.remove(r)
                    self._in_flight[r] = source
                    return r
                remaining = deadline - time.monotonic()
                if not self._in_flight or remaining <= 0:
                    return None
                self._cond.wait(remaining)

    def _pick(self, source: int) -> int | None:
        own = [r for r in self._pending if self.home(r) == source]
        if own:
            return own[0]
        orphaned = [r for r in self._pending if self.home(r) in self.errors]
        if orphaned:
            return orphaned[0]
        return self._pending[-1] if self._pending else None

    def finish(self, r: int, source: int) -> None:
        """`source` delivered range `r`, checksums verified."""
        with self._cond:
            self._check_in_flight(r, source)
            del self._in_flight[r]
            self._done[r] = source
            self._cond.notify_all()

    def fail(self, r: int | None, source: int, error: BaseException) -> None:
        """`source` failed (while fetching range `r`, if not None): drop it,
        and put `r` back for the remaining sources."""
        with self._cond:
            self.errors.setdefault(source, error)
            if r is not None:
                self._check_in_flight(r, source)
                del self._in_flight[r]
                self._pending.insert(0, r)
                self.refetched += 1
            self._cond.notify_all()

    def give_back(self, r: int, source: int) -> None:
        """`source` cannot serve range `r` yet (not staged): `r` goes back to
        pending and `source` stays alive, to try again."""
        with self._cond:
            self._check_in_flight(r, source)
            del self._in_flight[r]
            self._pending.insert(0, r)
            self._cond.notify_all()

    def _check_in_flight(self, r: int, source: int) -> None:
        if self._in_flight.get(r) != source:
            raise RuntimeError(f"range {r} is not being fetched by source {source}")

    def complete(self) -> bool:
        with self._cond:
            return len(self._done) == self.num_ranges

    def failed(self) -> bool:
        """Every source is dead and some range is not done: nothing can finish it."""
        return len(self.errors) == self.num_sources and len(self._done) < self.num_ranges

    def delivered_by(self) -> dict[int, list[int]]:
        """source -> the ranges it delivered."""
        with self._cond:
            out: dict[int, list[int]] = {s: [] for s in range(self.num_sources)}
            for r, s in sorted(self._done.items()):
                out[s].append(r)
            return out


def layout_difference(a: bytes, b: bytes) -> str | None:
    """Why two raw JSON headers describe different states, or None if they
    describe the same one. Device indices are ignored ("cuda:0" and "cuda:1"
    hold the same bytes); everything else (step, checksum algorithm, tree,
    dtypes, shapes, non-tensor values) must be equal."""
    if a == b:
        return None
    ha, hb = state_format.decode_header(a), state_format.decode_header(b)
    if ha.step != hb.step:
        return f"step {ha.step} vs {hb.step}"
    if ha.checksum != hb.checksum:
        return f"checksum {ha.checksum} vs {hb.checksum} (one peer lacks the crc32c package)"
    if len(ha.specs) != len(hb.specs):
        return f"{len(ha.specs)} vs {len(hb.specs)} tensors"
    for sa, sb in zip(ha.specs, hb.specs):
        if (sa.path, sa.dtype, sa.shape) != (sb.path, sb.dtype, sb.shape):
            return (
                f"tensor {sa.path} {sa.dtype} {list(sa.shape)} vs "
                f"{sb.path} {sb.dtype} {list(sb.shape)}"
            )
    if _without_device_index(ha.tree) != _without_device_index(hb.tree):
        return "the non-tensor values or the tree's structure differ"
    return None


def _without_device_index(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            k: (
                v.split(":")[0]
                if k == "device" and isinstance(v, str)
                else _without_device_index(v)
            )
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_without_device_index(v) for v in node]
    return node


@dataclass
class StripeReport:
    """What each source contributed to one striped fetch."""

    sources: list[str]
    bytes_by_source: list[int]
    ranges_by_source: list[list[int]]
    errors: dict[str, str] = field(default_factory=dict)
    """label -> why that source was dropped"""
    refetched: int = 0

    def summary(self) -> str:
        parts = [
            f"{label}: {n / 1e6:.1f} MB" for label, n in zip(self.sources, self.bytes_by_source)
        ]
        dropped = "".join(f"; dropped {label}: {why}" for label, why in self.errors.items())
        return ", ".join(parts) + dropped


class _SourceFetch(Fetch):
    """Fetch's connection handling for one source, with a stall bound: a
    read that waits longer than `stall_s` fails that source, not the fetch."""

    def __init__(
        self,
        source: HealSource,
        step: int,
        deadline: float,
        stall_s: float,
        secret: str | None,
        context: ssl.SSLContext | None,
    ) -> None:
        super().__init__(source, step, deadline, secret, context)
        self._stall_s = stall_s

    def _remaining(self) -> float:
        return min(super()._remaining(), self._stall_s)

    def abort(self) -> None:
        self._aborted = True
        for conn in self._conns:
            if conn.sock is not None:
                hang_up(conn.sock)


_SOURCE_ERRORS = (
    NotReady,
    Refused,
    ChecksumMismatch,
    OSError,
    http.client.HTTPException,
    ValueError,
)
"""What fails one source (and sends its range elsewhere). A LayoutMismatch
(a ValueError too) is caught before these: it ends the whole fetch."""


class StripedFetch:
    """One attempt to fetch a step's state striped across `sources`.

    Args:
        sources: peers serving the same step, the primary first (it is asked
            for the layout header first).
        step: the step every source must serve.
        deadline: time.monotonic() by which the state must be complete.
        ranges_per_source: ranges per source; more bound the bytes a failure
            refetches and let a faster link take over more of the work.
        streams_per_source: connections per source at once.
        stall_s: a source whose socket stays silent this long is dropped.
        progress: called as progress(source index, bytes) after every
            piece received (for reports and tests).
        device: where leaves the sources held on CUDA go
            (`staging.target_device`).
    """

    def __init__(
        self,
        sources: Sequence[HealSource],
        step: int,
        deadline: float,
        secret: str | None = None,
        context: ssl.SSLContext | None = None,
        ranges_per_source: int = 4,
        streams_per_source: int = 1,
        stall_s: float = 10.0,
        progress: Callable[[int, int], None] | None = None,
        device: torch.device | None = None,
    ) -> None:
        if not sources:
            raise ValueError("a striped fetch needs at least one source")
        if ranges_per_source < 1 or streams_per_source < 1 or stall_s <= 0:
            raise ValueError(
                f"ranges_per_source ({ranges_per_source}) and streams_per_source "
                f"({streams_per_source}) must be at least 1, stall_s ({stall_s}) positive"
            )
        num_ranges = len(sources) * ranges_per_source
        if num_ranges > MAX_RANGES:
            raise ValueError(
                f"{len(sources)} sources x {ranges_per_source} ranges exceed the server's "
                f"{MAX_RANGES} ranges; use fewer sources or ranges per source"
            )
        self.sources = list(sources)
        self._step, self._deadline = step, deadline
        self._streams = streams_per_source
        self._progress = progress
        self._device = device
        self._fetches = [
            _SourceFetch(s, step, deadline, stall_s, secret, context) for s in self.sources
        ]
        self.stripes = Stripes(num_ranges, len(self.sources))
        self._fatal: BaseException | None = None
        self._not_ready: NotReady | None = None
        self._lock = threading.Lock()
        self._bytes = [0] * len(self.sources)

    def run(self) -> tuple[Any, int, StripeReport]:
        """Returns the state, its number of tensor bytes and who sent what.

        Raises:
            LayoutMismatch: two sources serve different states.
            The last source's error (NotReady, Refused, ChecksumMismatch,
            OSError, ...) when every source failed before the state was whole.
        """
        prefaulter = None
        try:
            first = self._first_header()
            source, r, opened = first
            self._header_raw = opened[2]
            header = state_format.decode_header(self._header_raw)
            if header.step != self._step:
                raise ValueError(f"the header is of step {header.step}")
            self._update = checksum.updater(header.checksum)
            self._header = header
            nbytes = [spec.nbytes for spec in header.specs]
            self._ranges = state_format.chunk_ranges(sum(nbytes), self.stripes.num_ranges)
            self._segments = [state_format.segments(nbytes, a, b) for a, b in self._ranges]
            self._pieces = [pieces(nbytes, a, b) for a, b in self._ranges]
            self._check_length(r, opened[1])  # before allocating what the header claims
            self._tensors = [state_format.empty(spec) for spec in header.specs]
            prefaulter = self._prefaulter = Prefaulter(self._tensors, self._pieces)
            workers = [
                threading.Thread(
                    target=self._work,
                    args=(s, (r, opened) if (s, k) == (source, 0) else None),
                    name=f"torchft_checkpoint_stripe_{s}_{k}",
                    daemon=True,
                )
                for s in range(len(self.sources))
                for k in range(self._streams)
            ]
            for t in workers:
                t.start()
            for t in workers:
                t.join()
            if self._fatal is not None:
                raise self._fatal
            if not self.stripes.complete():
                raise self._last_error()
        finally:
            if prefaulter is not None:
                prefaulter.stop()
            for fetch in self._fetches:
                fetch.abort()
                fetch.close()
        tensors = staging.place(header.specs, self._tensors, self._device)
        report = StripeReport(
            sources=[s.label for s in self.sources],
            bytes_by_source=list(self._bytes),
            ranges_by_source=[v for _, v in sorted(self.stripes.delivered_by().items())],
            errors={
                self.sources[s].label: f"{type(e).__name__}: {e}"
                for s, e in self.stripes.errors.items()
            },
            refetched=self.stripes.refetched,
        )
        return state_format.unflatten(header.tree, tensors), sum(nbytes), report

    def _first_header(self) -> tuple[int, int, Any]:
        """Opens the first range of the first source that answers (the primary
        unless it fails): its header sizes the receive buffers."""
        for s, fetch in enumerate(self._fetches):
            r = self.stripes.take(s)
            if r is None:
                continue
            try:
                return s, r, fetch.open_range(r, self.stripes.num_ranges)
            except NotReady as e:  # maybe staged later: the next attempt asks again
                self._not_ready = e
                self.stripes.give_back(r, s)
            except _SOURCE_ERRORS as e:
                self._log_failure(s, r, e)
                self.stripes.fail(r, s, e)
        if self._not_ready is not None:
            raise self._not_ready
        raise self._last_error()

    def _last_error(self) -> BaseException:
        """The error to raise when no source is left: one worth retrying
        (not serving yet, a broken connection) over a refusal that is final."""
        errors = list(self.stripes.errors.values())
        if self._not_ready is not None and all(isinstance(e, TimeoutError) for e in errors):
            return self._not_ready  # what kept the sources from serving in time
        if not errors:
            return TimeoutError("no source delivered its ranges before the deadline")
        retryable = [e for e in errors if not isinstance(e, Refused)]
        return (retryable or errors)[-1]

    def _check_length(self, r: int, response: http.client.HTTPResponse) -> None:
        start, end = self._ranges[r]
        trailer = checksum.ITEM.size * len(self._segments[r])
        if response.length != end - start + trailer:
            raise ValueError(
                f"range {r} has {response.length} bytes after its header, not "
                f"{end - start} of data and {trailer} of checksums"
            )

    def _work(self, s: int, opened: tuple[int, Any] | None) -> None:
        fetch = self._fetches[s]
        remaining = lambda: max(0.0, self._deadline - time.monotonic())  # noqa: E731
        while True:
            if opened is not None:
                (r, first), opened = opened, None
            else:
                r_next = self.stripes.take(s, timeout=remaining())
                if r_next is None:
                    return
                r, first = r_next, None
            try:
                self._fill(s, fetch, r, first)
            except NotReady as e:  # not staged yet (it learns of the quorum later): wait
                self._not_ready = e
                self.stripes.give_back(r, s)
                time.sleep(_RETRY_S)
                continue
            except LayoutMismatch as e:
                self._fatal = self._fatal or e
                for other in self._fetches:
                    other.abort()
                self.stripes.fail(r, s, e)
                return
            except _SOURCE_ERRORS as e:
                if self._fatal is None:
                    self._log_failure(s, r, e)
                self.stripes.fail(r, s, e)
                return
            except BaseException as e:  # a bug, not the source: end the fetch, not hang it
                self._fatal = self._fatal or e
                for other in self._fetches:
                    other.abort()
                self.stripes.fail(r, s, e)
                return
            self.stripes.finish(r, s)

    def _fill(self, s: int, fetch: _SourceFetch, r: int, first: Any) -> None:
        conn, response, raw = first or fetch.open_range(r, self.stripes.num_ranges)
        try:
            if raw != self._header_raw:
                why = layout_difference(self._header_raw, raw)
                if why is not None:
                    raise LayoutMismatch(
                        f"{self.sources[s].label} serves another state of step {self._step} "
                        f"than {self.sources[0].label}: {why}; peers at one step must hold "
                        "the same state bit for bit, so nothing was applied (heal from one "
                        "source, or find why the replicas differ)"
                    )
            self._check_length(r, response)
            crcs: dict[int, int] = {}
            for piece in self._pieces[r]:
                self._prefaulter.claim(piece)
                index, lo, hi = piece
                view = state_format.memview(self._tensors[index])[lo:hi]
                fetch.read_into(conn, response, view)
                crcs[index] = self._update(view, crcs.get(index, 0))  # releases the GIL
                if self._progress is not None:
                    self._progress(s, hi - lo)
            segments = self._segments[r]
            trailer = fetch.read(conn, response, checksum.ITEM.size * len(segments))
            sent = [crc for (crc,) in checksum.ITEM.iter_unpack(trailer)]
            for (index, offset, length), crc in zip(segments, sent):
                got = crcs.get(index, 0)
                if got != crc:
                    spec = self._header.specs[index]
                    raise ChecksumMismatch(
                        f"tensor {spec.path} bytes [{offset}, {offset + length}) from "
                        f"{self.sources[s].label} has {self._header.checksum} {got:08x}, the "
                        f"source sent {crc:08x}"
                    )
        finally:
            conn.close()
        start, end = self._ranges[r]
        with self._lock:  # counted once verified: a failed range is fetched again elsewhere
            self._bytes[s] += end - start

    def _log_failure(self, s: int, r: int | None, e: BaseException) -> None:
        logger.warning(
            "striped healing: dropping %s (range %s): %s: %s; its ranges go to the other sources",
            self.sources[s].label,
            r,
            type(e).__name__,
            e,
        )
