"""The serving side of HTTPTransport: the staged state of one step, the slot
that serves it, and the HTTP handler that streams it (our format whole or in checksummed chunks, or
torchft's) to a healing peer. See http_transport for the protocol."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Generator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

from lighthouse.rpc import auth
from lighthouse.web.server import QuietHTTPServer
from torchft_like.checkpointing import checksum, staging, state_format, torchft_http
from torchft_like.checkpointing.heal_source import KEY, OWN_PATH
from torchft_like.checkpointing.http_fetch import NOT_SERVING, SLICE, WRONG_STEP, hang_up

logger = logging.getLogger("torchft_like.checkpointing.http_transport")  # one name per transport

MAX_CHUNKS = 256


class Staged:
    """The state of one step as served: the live tensors and the encoded header."""

    def __init__(self, step: int, state_dict: Any, timeout: timedelta) -> None:
        tree, self.tensors = state_format.flatten(state_dict)
        self.state = state_dict
        self._cpu_state: Any = None
        self._lock = threading.Lock()
        self.step = step
        self.timeout = timeout
        self.header = state_format.encode_header(step, tree, checksum.DEFAULT)
        self.nbytes = [t.numel() * t.element_size() for t in self.tensors]
        self.checksums: dict[tuple[int, int, int], int] = {}
        """Per (tensor index, offset, length) segment, computed while it is
        first sent: once per served step, not once per receiver or retry."""
        self.ready = staging.record_ready(self.tensors)
        """Per CUDA device of the state, an event on the staging thread's
        stream: the copies to host that serve CUDA tensors wait for it, so
        they read the weights the last optimizer step wrote. Empty on CPU."""

    def cpu_state(self) -> Any:
        """The state with its tensors on the CPU, for torchft receivers;
        copied once per step, and only if a torchft receiver asks."""
        with self._lock:
            if self._cpu_state is None:
                self._cpu_state = torchft_http.on_cpu(self.state)
            return self._cpu_state


class ServingSlot:
    """The one step a source serves, and its transfers in flight: the
    transport stages and withdraws a step, the server's handlers begin and
    end transfers of it. Thread-safe."""

    def __init__(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._cond = threading.Condition()
        self._staged: Staged | None = None
        self._active: set[socket.socket] = set()
        self._closed = False

    def stage(self, staged: Staged) -> None:
        with self._cond:
            self._staged = staged
            self._cond.notify_all()  # torchft requests wait for their step

    def withdraw(self) -> None:
        """No step is served from now; waits for the transfers in flight
        (the staged step's timeout), then hangs up on what is left."""
        with self._cond:
            staged, self._staged = self._staged, None
            bound = (staged.timeout if staged else self._timeout).total_seconds()
            deadline = time.monotonic() + bound
            while self._active and (remaining := deadline - time.monotonic()) > 0:
                self._cond.wait(remaining)
            if self._active:
                logger.warning(
                    "cutting off %d state transfers still running after %.1f s, "
                    "so that the optimizer may write the weights",
                    len(self._active),
                    bound,
                )
                for conn in self._active:
                    hang_up(conn)

    def begin(
        self, step: int, conn: socket.socket, wait: bool = False
    ) -> tuple[Staged | None, int, str]:
        """Registers a transfer of `step`, or says why not (a status code and
        its text). `wait`: first wait (up to the timeout) for `step` to be
        staged, as torchft's receivers expect of a server."""
        with self._cond:
            deadline = time.monotonic() + self._timeout.total_seconds()
            while (
                wait
                and not self._closed
                and (self._staged is None or self._staged.step < step)
                and (remaining := deadline - time.monotonic()) > 0
            ):
                self._cond.wait(remaining)
            staged = self._staged
            if staged is None:
                return None, NOT_SERVING, "not serving: no state is staged on this replica now"
            if staged.step < step:  # this source has not reached its quorum's step yet
                return None, NOT_SERVING, f"not serving step {step} yet: serving {staged.step}"
            if staged.step != step:  # it moved past the step: can never serve it
                return (
                    None,
                    WRONG_STEP,
                    (
                        f"wrong step: serving {staged.step} but got step={step}; a receiver "
                        "asks for the step its quorum names, and only that step is served"
                    ),
                )
            self._active.add(conn)
            return staged, 200, ""

    def end(self, conn: socket.socket) -> None:
        with self._cond:
            self._active.discard(conn)
            self._cond.notify_all()

    def close(self) -> bool:
        """Serves nothing more; False if it was closed already."""
        with self._cond:
            if self._closed:
                return False
            self._closed = True
            self._staged = None
            self._cond.notify_all()
            return True


class Server(QuietHTTPServer):
    service = "checkpoint server"
    slot: ServingSlot
    secret: str | None
    refusals: auth.RefusalLog


class Server6(Server):
    address_family = socket.AF_INET6


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    default_request_version = "HTTP/1.0"
    """A two-word request line ("GET /x") is answered with a status line too,
    not in HTTP/0.9's bare-body style that a client cannot tell from data."""
    timeout = 60.0
    """Seconds a socket operation may wait: a peer that connects and goes
    silent is dropped instead of pinning a server thread for good."""
    server: Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        why = auth.http_refusal(self.headers, self.server.secret, "checkpoint server")
        if why is not None:
            self.server.refusals.refused(self.client_address[0], "a checkpoint GET", why)
            return self._refuse(401, why, auth.WWW_AUTHENTICATE)
        try:
            url = urlsplit(self.path)
        except ValueError as e:  # e.g. "http://[" as the target
            return self._refuse(400, f"unparsable request target {self.path[:100]!r}: {e}")
        match = re.fullmatch(r"(?:/torchft_like)?/checkpoint/(\d{1,19})", url.path)
        if match is None:
            torchft = re.fullmatch(r"(?:/torchft_like)?/checkpoint/(\d{1,19})/([^/]*)", url.path)
            if torchft is not None:
                return self._serve_torchft(int(torchft[1]), torchft[2])
            return self._refuse(
                404,
                f"unknown path {url.path!r}; use /checkpoint/{{step}}, or torchft's "
                f"{OWN_PATH}{{step}}/{KEY}",
            )
        try:
            chunk, of = parse_chunk(url.query)
        except ValueError as e:
            return self._refuse(400, str(e))
        staged, code, message = self.server.slot.begin(int(match[1]), self.connection)
        if staged is None:
            return self._refuse(code, message)
        try:
            self._send_state(staged, chunk, of)
        except OSError as e:
            self.close_connection = True
            logger.warning(
                "transfer of step %d to %s ended early: %s", staged.step, self.client_address[0], e
            )
        finally:
            self.server.slot.end(self.connection)

    def _serve_torchft(self, step: int, key: str) -> None:
        """torchft's scheme: the whole state of `step`, torch's streaming format."""
        if key != KEY:
            return self._refuse(
                400,
                f"key {key!r} is not served: torchft_like serves torchft's checkpoint format "
                f"whole only, at {OWN_PATH}{{step}}/{KEY} "
                "(torchft's HTTPTransport with num_chunks=0, its Manager's default)",
            )
        slot = self.server.slot
        staged, code, message = slot.begin(step, self.connection, wait=True)
        if staged is None:
            return self._refuse(code, message)
        try:
            state = staged.cpu_state()
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Connection", "close")  # the body ends when the connection does
            self.end_headers()
            self.close_connection = True
            torchft_http.encode(state, self.wfile)
        except OSError as e:
            logger.warning(
                "transfer of step %d to %s (torchft's format) ended early: %s",
                staged.step,
                self.client_address[0],
                e,
            )
        except Exception as e:  # e.g. a value torch.save cannot pickle: the body stops short
            self.close_connection = True
            logger.error(
                "cannot send step %d to %s in torchft's format: %s: %s",
                staged.step,
                self.client_address[0],
                type(e).__name__,
                e,
            )
        finally:
            slot.end(self.connection)

    def _not_allowed(self) -> None:
        body = f"method {self.command} not allowed; only GET is served".encode()
        self.send_response(405)
        self.send_header("Allow", "GET")
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")  # a request body, if any, stays unread
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    # Known methods get 405 (not http.server's 501); unknown ones keep 501 (RFC 9110).
    do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed  # noqa: N815
    do_TRACE = do_CONNECT = _not_allowed  # noqa: N815

    def _send_state(self, staged: Staged, chunk: int, of: int) -> None:
        start, end = state_format.chunk_ranges(sum(staged.nbytes), of)[chunk]
        segments = state_format.segments(staged.nbytes, start, end)
        trailer_len = checksum.ITEM.size * len(segments)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(staged.header) + end - start + trailer_len))
        self.end_headers()
        self.connection.sendall(staged.header)
        update = checksum.updater(checksum.DEFAULT)
        trailer = bytearray()
        rings: dict[Any, staging.HostRing] = {}  # per CUDA device, for this response
        for segment in segments:
            index, offset, length = segment
            known = staged.checksums.get(segment)
            crc = 0
            tensor = staged.tensors[index]
            if tensor.is_cuda:  # through pinned host buffers, copied while we send
                ring = rings.get(tensor.device)
                if ring is None:
                    ring = rings[tensor.device] = staging.HostRing(tensor.device, SLICE)
                with staging.on_device(tensor.device):
                    flat = state_format.flat_bytes(tensor)
                views = ring.read(flat, offset, offset + length, staged.ready.get(tensor.device))
            else:
                views = _cpu_views(state_format.flat_bytes(tensor), offset, offset + length)
            try:
                for view in views:
                    if known is None:  # about 0.6 ms per 8 MB slice, next to 5-8 ms of sendall
                        crc = update(view, crc)
                    self.connection.sendall(view)
            finally:  # a broken connection: the copies in flight finish before the slot ends
                views.close()
            if known is None:
                staged.checksums[segment] = known = crc
            trailer += checksum.ITEM.pack(known)
        self.connection.sendall(trailer)

    def _refuse(self, code: int, message: str, *headers: tuple[str, str]) -> None:
        body = message.encode()
        self.send_response(code)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("checkpoint server: " + format, *args)


def _cpu_views(flat: Any, start: int, end: int) -> Generator[memoryview, None, None]:
    """The bytes [start, end) of a CPU tensor's memory in SLICE views, no copy."""
    for lo in range(start, end, SLICE):
        yield state_format.memview(flat[lo : min(lo + SLICE, end)])


def parse_chunk(query: str) -> tuple[int, int]:
    if not query:
        return 0, 1
    params = parse_qs(query, keep_blank_values=True)
    try:
        if set(params) != {"chunk", "of"} or len(params["chunk"] + params["of"]) != 2:
            raise ValueError
        chunk, of = int(params["chunk"][0]), int(params["of"][0])
    except ValueError:
        raise ValueError(f"bad query {query!r}; use ?chunk=i&of=n") from None
    if not (1 <= of <= MAX_CHUNKS and 0 <= chunk < of):
        raise ValueError(f"chunk={chunk}&of={of} needs 0 <= chunk < of <= {MAX_CHUNKS}")
    return chunk, of
