"""Live state transfer over HTTP, streamed tensor by tensor, without pickle.

Routes (served only for the staged step):
  GET /checkpoint/{step}/header             the JSON tree (see _format)
  GET /checkpoint/{step}/data?chunk=i&of=n  raw bytes of the tensors of chunk i

The source serves the live tensors with no copy; the receiver preallocates
each tensor and reads into its memory, over `num_chunks` connections at once.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch

from torchft_like.checkpointing import _format
from torchft_like.checkpointing.transport import CheckpointTransport

logger = logging.getLogger(__name__)

_NOT_SERVING = 503
_WRONG_STEP = 409
_SEND_SLICE = 16 << 20  # bytes per sendall: large, so the GIL is rarely taken


class _Staged:
    """The state of one step, flattened once, shared by every request."""

    def __init__(self, step: int, state_dict: Any) -> None:
        self.step = step
        tree, tensors = _format.flatten(state_dict)
        # CUDA or strided tensors need one copy; contiguous CPU tensors none.
        self.tensors = [t.detach().cpu().contiguous() for t in tensors]
        self.header = json.dumps(tree).encode()
        self.chunks_of: dict[int, list[list[int]]] = {}

    def chunk(self, i: int, n: int) -> list[int]:
        if n not in self.chunks_of:
            sizes = [t.numel() * t.element_size() for t in self.tensors]
            self.chunks_of[n] = _format.chunks(sizes, n)
        return self.chunks_of[n][i]


class HTTPTransport(CheckpointTransport[Any]):
    """Every rank runs a small threaded HTTP server; `metadata()` is its URL.

    Args:
        timeout: default bound on transfers and on `disallow_checkpoint`.
        num_chunks: parallel connections per transfer (0 or 1: one).
        hostname: how peers reach this machine (default: its host name).
        port: port to listen on (0 picks a free one).
    """

    def __init__(
        self,
        timeout: timedelta,
        num_chunks: int = 0,
        hostname: str | None = None,
        port: int = 0,
    ) -> None:
        if num_chunks < 0:
            raise ValueError(f"num_chunks ({num_chunks}) must not be negative")
        self._timeout = timeout
        self._num_chunks = max(1, num_chunks)
        self._staged: _Staged | None = None
        self._active = 0
        self._cond = threading.Condition()
        self._server = ThreadingHTTPServer(("", port), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="checkpoint-http", daemon=True
        )
        self._thread.start()
        host = hostname or socket.gethostname()
        self._url = f"http://{host}:{self._server.server_address[1]}"
        self._stopped = False

    def metadata(self) -> str:
        return self._url

    # ---- source side ---------------------------------------------------------

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        staged = _Staged(step, state_dict)
        with self._cond:
            self._staged = staged
        logger.debug("serving step %d to replica ranks %s", step, dst_ranks)

    def disallow_checkpoint(self) -> None:
        deadline = time.monotonic() + self._timeout.total_seconds()
        with self._cond:
            self._staged = None
            while self._active and self._cond.wait(max(0.0, deadline - time.monotonic())):
                pass
            if self._active:
                logger.warning("%d state transfers still running after the timeout", self._active)

    def _begin(self, step: int) -> tuple[_Staged | None, int, str]:
        with self._cond:
            staged = self._staged
            if staged is None:
                return None, _NOT_SERVING, "not serving: no state is staged (not a source now)"
            if staged.step != step:
                return None, _WRONG_STEP, f"step {step} is not served; serving step {staged.step}"
            self._active += 1
            return staged, 200, ""

    def _end(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        transport = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                url = urlparse(self.path)
                parts = url.path.strip("/").split("/")
                if len(parts) != 3 or parts[0] != "checkpoint" or not parts[1].isdigit():
                    return self._error(404, "unknown path; use /checkpoint/{step}/header or /data")
                staged, code, message = transport._begin(int(parts[1]))
                if staged is None:
                    return self._error(code, message)
                try:
                    if parts[2] == "header":
                        self._send_bytes(staged.header)
                    elif parts[2] == "data":
                        query = parse_qs(url.query)
                        n = int(query.get("of", ["1"])[0])
                        i = int(query.get("chunk", ["0"])[0])
                        if not 0 <= i < n:
                            return self._error(400, f"chunk {i} is not in [0, {n})")
                        self._send_tensors([staged.tensors[k] for k in staged.chunk(i, n)])
                    else:
                        self._error(404, f"unknown part {parts[2]!r}; use header or data")
                except (BrokenPipeError, ConnectionResetError):
                    logger.info("a receiver hung up during a transfer")
                finally:
                    transport._end()

            def _send_bytes(self, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _send_tensors(self, tensors: list[torch.Tensor]) -> None:
                self.send_response(200)
                self.send_header(
                    "Content-Length", str(sum(t.numel() * t.element_size() for t in tensors))
                )
                self.end_headers()
                self.wfile.flush()
                for tensor in tensors:
                    data = _format.as_bytes(tensor)
                    for start in range(0, len(data), _SEND_SLICE):
                        self.connection.sendall(data[start : start + _SEND_SLICE])

            def _error(self, code: int, message: str) -> None:
                body = message.encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("checkpoint server: " + format, *args)

        return Handler

    # ---- receiver side -------------------------------------------------------

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """Fetches step `step` from `metadata`, retrying while the source has not
        staged it yet, until `timeout`."""
        deadline = time.monotonic() + timeout.total_seconds()
        last = ""
        while True:
            try:
                return self._fetch(metadata, step, deadline)
            except _NotReady as e:
                last = str(e)
            except OSError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() + 0.05 > deadline:
                raise RuntimeError(
                    f"could not fetch the state of step {step} from {metadata} (replica rank "
                    f"{src_rank}) within {timeout.total_seconds():.1f} s; last answer: {last}"
                )
            time.sleep(0.05)

    def _fetch(self, metadata: str, step: int, deadline: float) -> Any:
        url = urlparse(metadata)
        if not url.hostname or not url.port:
            raise ValueError(f"checkpoint metadata {metadata!r} is not an http://host:port URL")

        def get(path: str) -> http.client.HTTPResponse:
            conn = http.client.HTTPConnection(
                url.hostname, url.port, timeout=max(0.1, deadline - time.monotonic())
            )
            conn.request("GET", path)
            response = conn.getresponse()
            if response.status != 200:
                message = response.read().decode(errors="replace")
                conn.close()
                if response.status in (_NOT_SERVING, _WRONG_STEP):
                    raise _NotReady(message)
                raise RuntimeError(f"{metadata}{path} answered {response.status}: {message}")
            return response

        tree = json.loads(get(f"/checkpoint/{step}/header").read())
        specs = _format.tensor_specs(tree)
        tensors = [_format.empty_like_spec(s) for s in specs]
        plan = _format.chunks([s["nbytes"] for s in specs], self._num_chunks)

        def read_chunk(i: int) -> None:
            response = get(f"/checkpoint/{step}/data?chunk={i}&of={len(plan)}")
            try:
                for index in plan[i]:
                    _read_exactly(response, _format.as_bytes(tensors[index]))
            finally:
                response.close()

        if len(plan) == 1:
            read_chunk(0)
        else:
            with ThreadPoolExecutor(len(plan), thread_name_prefix="checkpoint-recv") as pool:
                list(pool.map(read_chunk, range(len(plan))))
        for i, spec in enumerate(specs):
            if spec["device"].startswith("cuda") and torch.cuda.is_available():
                tensors[i] = tensors[i].to(spec["device"])
        return _format.unflatten(tree, tensors)

    def shutdown(self, wait: bool = True) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=5)


class _NotReady(Exception):
    """The source does not serve this step (yet): worth retrying."""


def _read_exactly(response: http.client.HTTPResponse, out: memoryview) -> None:
    view = out.cast("B") if out.format != "B" else out
    got = 0
    while got < len(view):
        n = response.readinto(view[got:])
        if not n:
            raise ConnectionError(f"transfer cut short: {got} of {len(view)} bytes of a tensor")
        got += n
