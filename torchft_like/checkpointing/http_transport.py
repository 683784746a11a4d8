"""Live state transfer between replicas over HTTP, without pickle and without copies.

Every rank runs a small threaded HTTP server. A source stages a reference to
its live state dict for one step; a receiver asks for exactly that step:

  GET /checkpoint/{step}                   the whole state as one stream
  GET /checkpoint/{step}?chunk=i&of=n      the header plus the i-th of n
                                           equal byte ranges of tensor data
  GET /checkpoint/{step}/full              torchft's URL and format, so a
                                           torchft group can heal from us
                                           (`torchft_http`)

each also under the prefix /torchft_like, the path of `metadata()`.

A 200 body is a stream in the format of `state_format` (prefix, JSON header, raw
tensor bytes). Refusals are text/plain: 401 without the job's secret (when
the transport has one, see lighthouse.rpc.auth), 503 "not serving" when nothing is
staged, 400 "wrong step" when another step is staged (never stale weights;
torchft's code and text), 404 and 400 for requests that are not of the above
shape. A receiver retries only 503 (and broken connections) until its
deadline; any other refusal cannot change, so it fails at once. A request
in torchft's scheme that comes before its step is staged waits for it (up
to the transport's timeout), as torchft's server makes it.

`metadata()` is ``http://host:port/torchft_like/checkpoint/``: torchft's
receiver appends ``{step}/full`` to it; ours parses it once, on the way
in, into a `heal_source.HealSource` that the fetches below read, and
fetches from a peer whose metadata is torchft's own
(``http://host:port/checkpoint/``) in torchft's format, weights_only.

Replicas at one step hold the same state bit for bit, so a receiver may
also take a distinct chunk of it from each of several sources at once
(`recv_checkpoint_striped`, see `striped`): no one sender's link bounds
the heal, and a source that fails leaves its chunks to the others.

Speed comes from touching each byte once on either side: the source sends
slices of the live tensors' memory with socket sendall (contiguous CPU
tensors are not copied; others are copied one slice at a time), and the
receiver preallocates every tensor from the header and reads the socket
straight into its memory.

CUDA state: a source copies its CUDA tensors to host through a few pinned
buffers on a side stream, each slice copied while the previous one is on
the wire (`staging.HostRing`). A receiver puts each leaf the source held
on CUDA onto its own GPU (the transport's `device`), through pinned buffers
too, and leaves CPU leaves (optimizer step counters) on the CPU; without
CUDA everything stays on the CPU.
"""

from __future__ import annotations

import http.client
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from lighthouse.rpc import auth
from lighthouse.rpc.address import BIND_HOST_ENV
from lighthouse.rpc.tls import FIX, TLSConfig, check_scheme, is_refusal, scheme
from torchft_like.checkpointing import staging, striped, torchft_http
from torchft_like.checkpointing.heal_source import OWN_PATH, HealSource, heal_fetch
from torchft_like.checkpointing.http_fetch import (
    GONE_AFTER_S,
    ChecksumMismatch,
    DeadlinePassed,
    Fetch,
    FetchRefused,
    FetchSourceGone,
    FetchTimeout,
    FetchTLSError,
    NotReady,
    Refused,
    refused,
)
from torchft_like.checkpointing.http_serve import (
    MAX_CHUNKS,
    Handler,
    Server,
    Server6,
    ServingSlot,
    Staged,
)
from torchft_like.checkpointing.transport import CheckpointTransport

logger = logging.getLogger(__name__)

_RETRY_S = 0.05


class HTTPTransport(CheckpointTransport[Any]):
    """Serves this rank's staged state over HTTP and fetches peers' states.

    The server starts in the constructor and listens on the address it
    advertises (`hostname`) unless `bind_host` says otherwise;
    `metadata()` is ``http://{hostname}:{port}/torchft_like/checkpoint/``.
    Peers may be torchft's HTTPTransport too, in either direction (torchft's
    format, decoded weights_only; no secret and no TLS on that path).

    Args:
        timeout: how long `disallow_checkpoint` waits for transfers in flight
            when no step is staged (a staged step uses the timeout given to
            `send_checkpoint`).
        num_chunks: parallel connections per fetch; 0 or 1 means one.
            More can use more bandwidth on fast multi-core links.
        hostname: the name peers use to reach this rank. The default,
            ``socket.gethostname()``, is what cluster launchers use for
            hosts and costs no DNS lookup (``getfqdn`` does a reverse lookup
            that can stall for seconds); "127.0.0.1" would only work when
            every replica shares this machine.
        port: port to listen on; 0 picks a free one.
        bind_host: host to listen on; None: `hostname` (what peers are told),
            so the server is not open on interfaces nobody was told of.
            "0.0.0.0" or "::" for all interfaces (the Manager passes
            TORCHFT_BIND_HOST here).
        secret: the job's shared secret: required of every request served,
            and sent with every fetch. None: access control off.
        tls: serve HTTPS and fetch over HTTPS (lighthouse.rpc.tls), with
            client certificates when `tls.client_auth`; `metadata()` is then
            ``https://...``. None: plain HTTP.
        device: where received leaves that the source held on CUDA go: the
            device this rank's model lives on. None: the current CUDA device
            when CUDA is initialized in the thread building the transport,
            else cuda:(LOCAL_RANK % GPUs) at receive time; the CPU without
            CUDA (see `staging`). Leaves the source held on the CPU stay there.

    Raises:
        ValueError: a negative num_chunks or timeout, or a port out of range.
        OSError: the port cannot be bound (e.g. in use).
    """

    can_stripe = True
    reports_begun = True

    def __init__(
        self,
        timeout: timedelta,
        num_chunks: int = 0,
        hostname: str | None = None,
        port: int = 0,
        secret: str | None = None,
        bind_host: str | None = None,
        tls: TLSConfig | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if timeout <= timedelta(0):
            raise ValueError(f"timeout ({timeout}) must be positive")
        if not 0 <= num_chunks <= MAX_CHUNKS:
            raise ValueError(f"num_chunks ({num_chunks}) must be in [0, {MAX_CHUNKS}]")
        if not 0 <= port <= 65535:
            raise ValueError(f"port ({port}) must be in [0, 65535]; 0 picks a free one")
        self._timeout = timeout
        self._num_chunks = max(1, num_chunks)
        self.device = staging.resolve_device(device)
        """Where received CUDA leaves go (None: resolved at receive time)."""
        if secret is not None:
            auth.validate_secret(secret, "HTTPTransport's `secret` argument")
        self.secret = secret
        self.tls = tls
        self._client_context = tls.client_context() if tls is not None else None
        self._slot = ServingSlot(timeout)
        self.last_stripe_report: striped.StripeReport | None = None
        """Who sent what in the last `recv_checkpoint_striped`."""
        host = hostname or socket.gethostname()
        listen = (bind_host if bind_host is not None else host).strip("[]")
        server_class = Server6 if ":" in listen else Server
        try:
            self._server = server_class((listen, port), Handler)
        except (OSError, UnicodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise OSError(
                getattr(e, "errno", None),
                f"checkpoint server cannot listen on port "
                f"{port} of {listen!r}: {why}; pass port=0 to pick a free one, or "
                f"set {BIND_HOST_ENV} (bind_host) to an address of this machine",
            ) from e
        self._server.slot = self._slot
        self._server.secret = secret
        if tls is not None:
            self._server.ssl_context = tls.server_context()
        self._server.refusals = auth.RefusalLog()
        self._thread = threading.Thread(
            target=self._serve, name="torchft_checkpoint_http", daemon=True
        )
        self._thread.start()
        warning = auth.exposure_warning(secret, listen, "checkpoint server")
        if warning:
            logger.warning("%s", warning)
        host = f"[{host}]" if ":" in host else host
        self._url = f"{scheme(tls)}://{host}:{self._server.server_address[1]}"
        self._metadata = self._url + OWN_PATH

    def metadata(self) -> str:
        """See base class: ``http://host:port/torchft_like/checkpoint/``."""
        return self._metadata

    # --- source side --------------------------------------------------------

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        """Stages a reference to `state_dict` for `step`; copies nothing.

        The tree is walked now, so unsupported values fail here, in the
        caller, with a TypeError naming their key path. `timeout` bounds
        how long `disallow_checkpoint` waits for this step's transfers.
        """
        staged = Staged(step, state_dict, timeout)
        self._slot.stage(staged)
        logger.debug(
            "serving step %d (%d tensors) to replica ranks %s", step, len(staged.nbytes), dst_ranks
        )

    def disallow_checkpoint(self) -> None:
        """See base class."""
        self._slot.withdraw()

    def _serve(self) -> None:
        try:
            self._server.serve_forever()
        except Exception:
            logger.exception("checkpoint server stopped")

    # --- receiver side ------------------------------------------------------

    def recv_checkpoint(
        self,
        src_rank: int,
        metadata: str,
        step: int,
        timeout: timedelta,
        on_begun: Callable[[], None] | None = None,
    ) -> Any:
        """See base class. Retries "not serving", connection errors (a
        truncated body among them) and checksum mismatches every 50 ms until
        `timeout`, but a source that refuses every connection for a second
        (GONE_AFTER_S) is dead, and the heal fails then. `on_begun` is
        called when a torchft_like source has accepted the transfer, which it
        then serves to the end even once its step moves on
        (disallow_checkpoint waits for it). The state is
        returned only once every tensor has its announced size and checksum.
        From a torchft source (its metadata's path is ``/checkpoint/``) the
        state comes in torchft's format, which has no checksums: it is
        decoded by torch's weights_only unpickler only, and a body cut short
        is refused (see `torchft_http`); server errors (5xx) are retried
        like "not serving".

        Raises:
            FetchRefused: (an HTTPError and a RuntimeError) the source refused
                for good, e.g. it serves another step: raised at once.
            FetchTLSError: (a URLError and a RuntimeError) the TLS handshake
                failed for good (a certificate refused on either side).
            FetchSourceGone: (a URLError and a RuntimeError) nothing listens at
                the source's address any more: its process is gone.
            FetchTimeout: (a URLError and a RuntimeError) no state within
                `timeout`; the message says the last answer.
            UnsafeStateError: (a ValueError) a torchft source's state needs
                more than torch's weights_only unpickler allows: refused.
            ValueError: the source sent something that is not a state stream,
                or `metadata` is not a torchft_like or torchft HTTP address
                (BadMetadata) or not of this process's scheme.
        """
        return self._receive(self._source(src_rank, metadata), step, timeout, on_begun)

    def _receive(
        self,
        source: HealSource,
        step: int,
        timeout: timedelta,
        on_begun: Callable[[], None] | None,
    ) -> Any:
        """`recv_checkpoint` from one parsed source."""
        where = f"step {step} from {source.label}"

        def attempt(deadline: float) -> tuple[Any, int]:
            if source.torchft:  # one stream, torchft's format, decoded weights_only
                return torchft_http.fetch(source, step, deadline)
            fetch = Fetch(
                source,
                step,
                deadline,
                self.secret,
                self._client_context,
                on_begun,
                self.device,
            )
            return fetch.run(self._num_chunks)

        started = time.monotonic()
        requested = source.state_url(step)
        state, nbytes = self._retrying(attempt, step, source.metadata, where, requested, timeout)
        took = time.monotonic() - started
        logger.info(
            "received step %d from %s: %.1f MB in %.2f s (%.0f MB/s, %d streams%s)",
            step,
            source.metadata,
            nbytes / 1e6,
            took,
            nbytes / 1e6 / max(took, 1e-9),
            1 if source.torchft else self._num_chunks,
            ", torchft's format" if source.torchft else "",
        )
        return state

    def recv_checkpoint_striped(
        self,
        sources: Sequence[tuple[int, str]],
        step: int,
        timeout: timedelta,
        *,
        on_begun: Callable[[], None] | None = None,
        ranges_per_source: int = 4,
        stall_timeout: timedelta = timedelta(seconds=10),
    ) -> Any:
        """Fetches `step` striped across several peers that serve it: a
        distinct byte range from each at once (see `striped`), so that no one
        sender's link bounds the heal.

        Args:
            sources: (replica rank, metadata) of peers at `step`, the primary
                first. Whether they are fetched striped or the first alone
                (one distinct source, or a torchft peer among them) is
                `heal_source.heal_fetch`'s rule.
            on_begun: as `recv_checkpoint`'s, when the rule picks one source;
                a striped fetch does not call it (its collectives wait for
                the whole transfer).
            ranges_per_source: byte ranges per source; a failed source's
                unfinished range is fetched again, whole, from another.
            stall_timeout: a source silent this long mid-range is dropped and
                its range goes to the others (the whole fetch still has
                `timeout`).

        Retries like `recv_checkpoint` when every source failed; the state is
        returned only once every range matches its source's checksums.
        `last_stripe_report` then says which source sent what.

        Raises:
            ValueError: (LayoutMismatch) two sources describe different
                states, `sources` is empty, or a source's metadata is bad
                (BadMetadata) or not of this process's scheme.
            RuntimeError: as `recv_checkpoint` (its errors are RuntimeErrors
                too), when every source failed.
        """
        if not sources:
            raise ValueError("recv_checkpoint_striped needs at least one (rank, metadata) source")
        plan = heal_fetch([self._source(rank, metadata) for rank, metadata in sources])
        if not plan.striped:
            return self._receive(plan.first, step, timeout, on_begun)
        names = ", ".join(s.metadata for s in plan.sources)
        where = f"step {step} striped from {len(plan.sources)} replicas ({names})"
        reports: list[striped.StripeReport] = []

        def attempt(deadline: float) -> tuple[Any, int]:
            fetch = striped.StripedFetch(
                plan.sources,
                step,
                deadline,
                self.secret,
                self._client_context,
                ranges_per_source=ranges_per_source,
                streams_per_source=self._num_chunks,
                stall_s=stall_timeout.total_seconds(),
                device=self.device,
            )
            state, nbytes, report = fetch.run()
            reports.append(report)
            return state, nbytes

        started = time.monotonic()
        state, nbytes = self._retrying(attempt, step, plan.first.metadata, where, where, timeout)
        took = time.monotonic() - started
        self.last_stripe_report = reports[-1]
        logger.info(
            "received step %d striped from %d replicas: %.1f MB in %.2f s (%.0f MB/s; %s)",
            step,
            len(plan.sources),
            nbytes / 1e6,
            took,
            nbytes / 1e6 / max(took, 1e-9),
            reports[-1].summary(),
        )
        return state

    def _source(self, replica_rank: int, metadata: str) -> HealSource:
        """`metadata` parsed, the one parse on its way down, and checked
        against this process's scheme (TLS or not)."""
        source = HealSource.parse(replica_rank, metadata)
        if source.scheme != scheme(self.tls):
            check_scheme(metadata, self.tls, "checkpoint server address")  # raises, with the fix
        return source

    def _retrying(
        self,
        attempt: Callable[[float], tuple[Any, int]],
        step: int,
        metadata: str,
        where: str,
        requested: str,
        timeout: timedelta,
    ) -> tuple[Any, int]:
        """Runs `attempt(deadline)` until it returns, retrying what may pass
        (not serving yet, broken connections, checksum mismatches) every
        50 ms until `timeout`, and raising at once what cannot. A source that
        refuses every connection for GONE_AFTER_S is gone: FetchSourceGone."""
        deadline = time.monotonic() + timeout.total_seconds()
        last, attempts = "no answer", 0
        refused_since: float | None = None
        while True:
            attempts += 1
            refusing = False
            if refused_since is not None and time.monotonic() - refused_since >= GONE_AFTER_S:
                raise FetchSourceGone(
                    f"could not fetch {where}: it refused every connection for "
                    f"{GONE_AFTER_S:g} s ({attempts - 1} attempts; {last}), so nothing listens "
                    "there: its process is gone, and the next quorum leaves it out"
                )
            try:
                return attempt(deadline)
            except NotReady as e:
                last = str(e)
            except Refused as e:
                raise FetchRefused(
                    requested,
                    e.status,
                    f"could not fetch {where}: {e}",
                    None,  # type: ignore[arg-type]
                    None,
                ) from None
            except ssl.SSLError as e:
                if not is_refusal(e):  # e.g. a hang-up mid-transfer: worth retrying
                    last = f"{type(e).__name__}: {e}"
                else:  # a certificate the other side refuses: retrying cannot help
                    raise FetchTLSError(f"could not fetch {where} over TLS: {e}; {FIX}") from None
            except ChecksumMismatch as e:  # corrupted on the way: nothing was applied
                last = f"{type(e).__name__}: {e}"
                logger.warning("refused step %d from %s, will retry: %s", step, metadata, e)
            except (OSError, http.client.HTTPException) as e:
                # An attempt the deadline cut short (ours, or a socket timeout
                # set to it) keeps the reason the earlier attempts failed for.
                cut_off = isinstance(e, DeadlinePassed) or (
                    isinstance(e, TimeoutError) and time.monotonic() >= deadline - _RETRY_S
                )
                if not (cut_off and attempts > 1):
                    last = f"{type(e).__name__}: {e}"
                if refused(e):
                    refused_since = refused_since or time.monotonic()
                    refusing = True
            except (torchft_http.UnsafeStateError, striped.LayoutMismatch):
                raise
            except ValueError as e:
                raise ValueError(f"{metadata} sent an invalid stream for step {step}: {e}") from e
            if not refusing:  # a refusal streak is broken by any other answer
                refused_since = None
            remaining = deadline - time.monotonic()
            if remaining <= _RETRY_S:
                raise FetchTimeout(
                    f"timed out: could not fetch {where} within "
                    f"{timeout.total_seconds():g} s ({attempts} attempts); last answer: {last}"
                )
            time.sleep(_RETRY_S)

    def shutdown(self, wait: bool = True) -> None:
        """See base class. Transfers in flight are not waited for."""
        if not self._slot.close():
            return
        if wait:
            self._stop()
        else:
            threading.Thread(
                target=self._stop, name="torchft_checkpoint_http_stop", daemon=True
            ).start()

    def _stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
