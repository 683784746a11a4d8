"""The receiving side of HTTPTransport: one attempt to fetch a step's state."""

from __future__ import annotations

import ctypes
import errno
import http.client
import itertools
import logging
import queue
import socket
import ssl
import threading
import time
import urllib.error
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import torch

from lighthouse.rpc import auth
from torchft_like.checkpointing import checksum, staging, state_format
from torchft_like.checkpointing.heal_source import HealSource

logger = logging.getLogger(__name__)

NOT_SERVING = 503
WRONG_STEP = 400
"""torchft's code for a request of a step other than the one served: the
source serves one step at a time, so retrying cannot make it succeed."""
SLICE = 8 << 20
"""Bytes per sendall / readinto call: large enough that the per-call cost
(and the GIL hand-off) vanishes, small enough to check the deadline often."""


class NotReady(Exception):
    """The source does not serve this step (yet): worth retrying."""


class Refused(Exception):
    """The source answered a refusal that retrying cannot change."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"answered HTTP {status}: {message}")
        self.status = status


class FetchRefused(urllib.error.HTTPError, RuntimeError):
    """A fetch the source refused for good (wrong step, bad request, no
    access): raised at once. An HTTPError, as torchft's receiver raises, and
    a RuntimeError, as `CheckpointTransport.recv_checkpoint` promises."""


class FetchTimeout(urllib.error.URLError, TimeoutError, RuntimeError):
    """No state within the timeout (not served yet, unreachable, damaged on
    every attempt). A URLError, as torchft's receiver raises, and a
    RuntimeError, as `CheckpointTransport.recv_checkpoint` promises."""


class FetchSourceGone(urllib.error.URLError, RuntimeError):
    """The source refused every connection for `GONE_AFTER_S`: nothing
    listens at its address, so its process is gone (its server listens from
    the start to the end of its life). Raised then instead of retrying to the
    transfer timeout: the heal fails, the step with it, and the next quorum,
    which no longer lists the dead source, heals from another peer."""


GONE_AFTER_S = 1.0


def refused(error: BaseException) -> bool:
    """A connection refused, bare or wrapped by urllib."""
    return isinstance(error, ConnectionRefusedError) or isinstance(
        getattr(error, "reason", None), ConnectionRefusedError
    )


class FetchTLSError(urllib.error.URLError, RuntimeError):
    """The TLS handshake with the source failed for good (its certificate
    not trusted, or ours refused): raised at once."""


class ChecksumMismatch(Exception):
    """Received bytes differ from what the source sent: worth retrying."""


class DeadlinePassed(TimeoutError):
    """The fetch's deadline passed before the state was complete."""


class Fetch:
    """One attempt to fetch a step over one or more connections."""

    def __init__(
        self,
        source: HealSource,
        step: int,
        deadline: float,
        secret: str | None = None,
        context: ssl.SSLContext | None = None,
        on_begun: Callable[[], None] | None = None,
        device: torch.device | None = None,
    ) -> None:
        """`source`: a torchft_like peer (torchft's are fetched by
        torchft_http). `context`: fetch over HTTPS with it; None: plain
        HTTP. `on_begun`: called once the source has accepted every stream
        (from then on it serves them to the end). `device`: where leaves the
        source held on CUDA go (`staging.target_device`)."""
        assert not source.torchft, "a torchft peer's state is fetched by torchft_http"
        self._source, self._step, self._deadline = source, step, deadline
        self._device = device
        self._context = context
        self._on_begun = on_begun
        self._accepted = 0
        self._accepted_lock = threading.Lock()
        self._headers = auth.http_headers(secret)
        self._conns: list[http.client.HTTPConnection] = []
        self._aborted = False
        self._prefaulter: Prefaulter | None = None

    def run(self, num_chunks: int) -> tuple[Any, int]:
        """Returns the state and its number of tensor bytes, once every
        tensor segment has the checksum the source sent for it."""
        verifier = None
        try:
            first = self.open_range(0, num_chunks)
            header = state_format.decode_header(first[2])
            if header.step != self._step:
                raise ValueError(f"the header is of step {header.step}")
            update = checksum.updater(header.checksum)
            nbytes = [spec.nbytes for spec in header.specs]
            ranges = state_format.chunk_ranges(sum(nbytes), num_chunks)
            segments = [state_format.segments(nbytes, start, end) for start, end in ranges]

            def check(i: int, response: http.client.HTTPResponse, raw: bytes) -> None:
                if raw != first[2]:
                    raise ValueError(f"chunk {i} has another header than chunk 0")
                start, end = ranges[i]
                trailer = checksum.ITEM.size * len(segments[i])
                if response.length != end - start + trailer:
                    raise ValueError(
                        f"chunk {i} has {response.length} bytes after its header, not "
                        f"{end - start} of data and {trailer} of checksums"
                    )

            check(0, first[1], first[2])  # before allocating what the header claims
            tensors = [state_format.empty(spec) for spec in header.specs]
            streams = [pieces(nbytes, start, end) for start, end in ranges]
            self._prefaulter = Prefaulter(tensors, streams)
            verifier = _Verifier(update)
            sent: list[list[int]] = [[] for _ in ranges]

            def fill(i: int) -> None:
                conn, response, raw = first if i == 0 else self.open_range(i, num_chunks)
                check(i, response, raw)
                for piece in streams[i]:
                    self._prefaulter.claim(piece)  # type: ignore[union-attr]
                    index, lo, hi = piece
                    view = state_format.memview(tensors[index])[lo:hi]
                    self.read_into(conn, response, view)
                    verifier.add((i, index), view)
                trailer = self.read(conn, response, checksum.ITEM.size * len(segments[i]))
                sent[i] = [crc for (crc,) in checksum.ITEM.iter_unpack(trailer)]

            if num_chunks == 1:
                fill(0)
            else:
                self._in_parallel(fill, num_chunks)
            self._verify(header, segments, sent, verifier.finish())
        finally:
            if self._prefaulter is not None:
                self._prefaulter.stop()
            if verifier is not None:
                verifier.stop()
            self.close()
        tensors = staging.place(header.specs, tensors, self._device)
        return state_format.unflatten(header.tree, tensors), sum(nbytes)

    def _verify(
        self,
        header: state_format.Header,
        segments: list[list[tuple[int, int, int]]],
        sent: list[list[int]],
        received: dict[tuple[int, int], int],
    ) -> None:
        bad = checksum.mismatches(segments, sent, received)
        if bad:
            (index, offset, length), got, crc = bad[0]
            spec = header.specs[index]
            more = f" (and {len(bad) - 1} more segments)" if len(bad) > 1 else ""
            raise ChecksumMismatch(
                f"tensor {spec.path} bytes [{offset}, {offset + length}) of {spec.nbytes} from "
                f"{self._source.base_url} has {header.checksum} {got:08x}, the source "
                f"sent {crc:08x}{more}; the state was not applied"
            )

    def close(self) -> None:
        """Closes every connection this fetch opened."""
        for conn in self._conns:
            conn.close()

    def open_range(
        self, chunk: int, of: int
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, bytes]:
        """Asks for range `chunk` of `of` of the staged step: the connection,
        its response and the state's header, once the source has begun."""
        host, port = self._source.host, self._source.port
        if self._context is None:
            conn = http.client.HTTPConnection(host, port, timeout=self._remaining())
        else:
            conn = http.client.HTTPSConnection(
                host, port, timeout=self._remaining(), context=self._context
            )
        self._conns.append(conn)
        path = self._source.state_path(self._step) + (f"?chunk={chunk}&of={of}" if of > 1 else "")
        conn.request("GET", path, headers=self._headers)
        response = conn.getresponse()
        if response.status != 200:
            message = response.read(4096).decode("utf-8", "replace")
            if response.status == NOT_SERVING:
                raise NotReady(message)
            raise Refused(response.status, message)
        with self._accepted_lock:
            self._accepted += 1
            if self._accepted == of and self._on_begun is not None:
                self._on_begun()
        header_len = state_format.decode_prefix(self.read(conn, response, state_format.PREFIX.size))
        return conn, response, self.read(conn, response, header_len)

    def _in_parallel(self, fill: Callable[[int], None], num_chunks: int) -> None:
        with ThreadPoolExecutor(num_chunks, thread_name_prefix="torchft_checkpoint_recv") as pool:
            futures = [pool.submit(fill, i) for i in range(num_chunks)]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                self._aborted = True
                for conn in self._conns:  # unblock the other streams at once
                    if conn.sock is not None:
                        hang_up(conn.sock)
                raise failed[0].exception()  # type: ignore[misc]

    def read(
        self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse, n: int
    ) -> bytes:
        out = bytearray(n)
        self.read_into(conn, response, memoryview(out))
        return bytes(out)

    def read_into(
        self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse, view: memoryview
    ) -> None:
        got = 0
        while got < len(view):
            if self._aborted:
                raise ConnectionAbortedError("another stream of this fetch failed")
            if conn.sock is not None:  # per call, so a trickle cannot pass the deadline
                conn.sock.settimeout(self._remaining())
            n = response.readinto(view[got : got + SLICE])
            if not n:
                raise ConnectionError(f"stream ended after {got} of {len(view)} bytes")
            got += n

    def _remaining(self) -> float:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlinePassed("the deadline passed during the transfer")
        return remaining


Piece = tuple[int, int, int]
"""(tensor index, first byte, end byte) of at most SLICE bytes: a unit of reading."""


def pieces(nbytes: list[int], start: int, end: int) -> list[Piece]:
    return [
        (index, lo, min(lo + SLICE, offset + length))
        for index, offset, length in state_format.segments(nbytes, start, end)
        for lo in range(offset, offset + length, SLICE)
    ]


class _Verifier:
    """Checksums received slices on a helper thread while the socket fills the next.

    The checksum functions release the GIL, so this costs the readers
    nothing but a queue put per slice (of up to SLICE bytes).
    """

    def __init__(self, update: checksum.Update) -> None:
        self._update = update
        self._queue: queue.SimpleQueue[tuple[tuple[int, int], memoryview] | None] = (
            queue.SimpleQueue()
        )
        self._crcs: dict[tuple[int, int], int] = {}
        self._error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(
            target=self._run, name="torchft_checkpoint_verify", daemon=True
        )
        self._thread.start()

    def add(self, key: tuple[int, int], view: memoryview) -> None:
        """Folds `view`, the next bytes of segment `key` = (stream, tensor index), in."""
        self._queue.put((key, view))

    def finish(self) -> dict[tuple[int, int], int]:
        """Waits for every slice added; returns each segment's checksum."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"checksumming the received state failed: {self._error}")
        return self._crcs

    def stop(self) -> None:
        """Drops what is queued (the fetch failed) and waits for the thread."""
        self._stopped = True
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._stopped or self._error is not None:
                continue
            key, view = item
            try:
                self._crcs[key] = self._update(view, self._crcs.get(key, 0))
            except Exception as e:
                logger.exception("checksumming a received slice failed")
                self._error = e


class Prefaulter:
    """Faults in the pages of the receiving tensors ahead of the socket reads.

    Fresh memory pays a page fault per 4 KiB page, and inside a socket read
    that cost adds to the transfer. A thread that faults the pages in ahead
    of the readers overlaps it with the network: receiving 100 MB was about
    1.3x faster with it on the 2-core dev VM. It asks the kernel to populate
    each piece (madvise MADV_POPULATE_WRITE, Linux 5.14+: one call per
    piece, no trap per page, about 20% cheaper than touching a byte a page
    here, and it writes no data); where the kernel refuses, it touches one
    byte a page. Either way it works only on pieces no reader has claimed,
    so it never overwrites received bytes.
    """

    _PAGE = 4096
    _MIN_TENSOR_BYTES = 1 << 20  # smaller tensors come from malloc's warm heap
    use_madvise = True
    """False touches every page instead (for comparison in bench.transfer)."""

    def __init__(self, tensors: list[torch.Tensor], streams: list[list[Piece]]) -> None:
        self._tensors = tensors
        # Round-robin over the streams, so that every reader finds its next
        # pieces faulted in; each reader faults its first piece itself, which
        # gives this thread a head start instead of a race.
        self._order = [
            piece
            for group in itertools.zip_longest(*(stream[1:] for stream in streams))
            for piece in group
            if piece is not None and tensors[piece[0]].nbytes >= self._MIN_TENSOR_BYTES
        ]
        self._cond = threading.Condition()
        self._claimed: set[Piece] = set()
        self._faulting: Piece | None = None
        self._stopped = False
        self._thread = threading.Thread(
            target=self._run, name="torchft_checkpoint_prefault", daemon=True
        )
        if self._order:
            self._thread.start()

    def claim(self, piece: Piece) -> None:
        """Reserves `piece` for a reader, after any touching of it finishes
        (a populate writes nothing, so a reader need not wait for one)."""
        with self._cond:
            while self._faulting == piece:
                self._cond.wait()
            self._claimed.add(piece)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        try:
            for piece in self._order:
                with self._cond:
                    if self._stopped:
                        return
                    if piece in self._claimed:
                        continue
                index, lo, hi = piece
                flat = state_format.flat_bytes(self._tensors[index])
                if self.use_madvise and _populate(flat.data_ptr() + lo, hi - lo):
                    continue
                with self._cond:  # touching writes: only a piece no reader holds
                    if piece in self._claimed:
                        continue
                    self._faulting = piece
                try:
                    flat[lo : hi : self._PAGE].zero_()  # torch releases the GIL here
                finally:
                    with self._cond:
                        self._faulting = None
                        self._cond.notify_all()
        except Exception:
            logger.exception("prefaulting the receive buffers failed; reads fault them in")


_MADV_POPULATE_WRITE = 23
_libc: ctypes.CDLL | None = None


def _populate(address: int, nbytes: int) -> bool:
    """Faults in the whole pages of [address, address + nbytes) for writing,
    without writing them; False where the kernel cannot (then touch them)."""
    global _libc
    start = -(-address // Prefaulter._PAGE) * Prefaulter._PAGE
    end = (address + nbytes) // Prefaulter._PAGE * Prefaulter._PAGE
    if end <= start:
        return True  # no whole page: the reader faults it in
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if _libc.madvise(start, end - start, _MADV_POPULATE_WRITE) == 0:  # releases the GIL
            return True
        code = ctypes.get_errno()
    except (OSError, AttributeError) as e:  # no libc.madvise (not Linux)
        code = getattr(e, "errno", None) or errno.ENOSYS
    Prefaulter.use_madvise = False
    logger.info(
        "madvise(MADV_POPULATE_WRITE) failed (%s); touching pages instead",
        errno.errorcode.get(code, code),
    )
    return False


def hang_up(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
