"""The receiving side of HTTPTransport: one attempt to fetch a step's state."""

from __future__ import annotations

import http.client
import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import torch

from torchft_like.checkpointing import _format

logger = logging.getLogger(__name__)

NOT_SERVING = 503
WRONG_STEP = 409
SLICE = 32 << 20
"""Bytes per sendall / readinto call: large enough that the per-call cost
(and the GIL hand-off) vanishes, small enough to check the deadline often."""


class NotReady(Exception):
    """The source does not serve this step (yet): worth retrying."""


class DeadlinePassed(TimeoutError):
    """The fetch's deadline passed before the state was complete."""


class Fetch:
    """One attempt to fetch a step over one or more connections."""

    def __init__(self, host: str, port: int, step: int, deadline: float) -> None:
        self._host, self._port, self._step, self._deadline = host, port, step, deadline
        self._conns: list[http.client.HTTPConnection] = []
        self._aborted = False

    def run(self, num_chunks: int) -> tuple[Any, int]:
        """Returns the state and its number of tensor bytes."""
        try:
            first = self._open(0, num_chunks)
            header = _format.decode_header(first[2])
            if header.step != self._step:
                raise ValueError(f"the header is of step {header.step}")
            nbytes = [spec.nbytes for spec in header.specs]
            ranges = _format.chunk_ranges(sum(nbytes), num_chunks)

            def check(i: int, response: http.client.HTTPResponse, raw: bytes) -> None:
                if raw != first[2]:
                    raise ValueError(f"chunk {i} has another header than chunk 0")
                start, end = ranges[i]
                if response.length != end - start:
                    raise ValueError(
                        f"chunk {i} has {response.length} bytes of data, not {end - start}"
                    )

            check(0, first[1], first[2])  # before allocating what the header claims
            tensors = [_format.empty(spec) for spec in header.specs]

            def fill(i: int) -> None:
                conn, response, raw = first if i == 0 else self._open(i, num_chunks)
                check(i, response, raw)
                start, end = ranges[i]
                for index, offset, length in _format.segments(nbytes, start, end):
                    view = _format.memview(tensors[index])[offset : offset + length]
                    self._read_into(conn, response, view)

            if num_chunks == 1:
                fill(0)
            else:
                self._in_parallel(fill, num_chunks)
        finally:
            for conn in self._conns:
                conn.close()
        for i, spec in enumerate(header.specs):
            if spec.device.startswith("cuda") and torch.cuda.is_available():
                tensors[i] = tensors[i].to("cuda")
        return _format.unflatten(header.tree, tensors), sum(nbytes)

    def _open(
        self, chunk: int, of: int
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, bytes]:
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self._remaining())
        self._conns.append(conn)
        path = f"/checkpoint/{self._step}" + (f"?chunk={chunk}&of={of}" if of > 1 else "")
        conn.request("GET", path)
        response = conn.getresponse()
        if response.status != 200:
            message = response.read(4096).decode("utf-8", "replace")
            if response.status in (NOT_SERVING, WRONG_STEP):
                raise NotReady(message)
            raise RuntimeError(f"GET {path} answered HTTP {response.status}: {message}")
        header_len = _format.decode_prefix(self._read(conn, response, _format.PREFIX.size))
        return conn, response, self._read(conn, response, header_len)

    def _in_parallel(self, fill: Callable[[int], None], num_chunks: int) -> None:
        with ThreadPoolExecutor(num_chunks, thread_name_prefix="checkpoint-recv") as pool:
            futures = [pool.submit(fill, i) for i in range(num_chunks)]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                self._aborted = True
                for conn in self._conns:  # unblock the other streams at once
                    if conn.sock is not None:
                        hang_up(conn.sock)
                raise failed[0].exception()  # type: ignore[misc]

    def _read(
        self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse, n: int
    ) -> bytes:
        out = bytearray(n)
        self._read_into(conn, response, memoryview(out))
        return bytes(out)

    def _read_into(
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


def hang_up(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
