"""The far end of an HTTP/2 connection under test, without a socket: an
asyncio transport that records what the protocol writes."""

from __future__ import annotations

import struct
from typing import Any

from lighthouse.rpc.h2 import frames
from lighthouse.rpc.h2.limits import LIMITS, Limits
from lighthouse.rpc.h2.server_connection import Connection
from lighthouse.rpc.h2.shares import ProcessBudget


class FakeTransport:
    """Records writes. With `reads=False` it is a peer that takes none of
    them: past `high` unsent bytes the protocol's `pause_writing` is called,
    as asyncio's transports do."""

    def __init__(self, protocol: Any = None, reads: bool = True, host: str = "127.0.0.1") -> None:
        self.protocol, self.reads, self.host = protocol, reads, host
        self.out = bytearray()
        self.closed = False
        self.cut = False
        """Aborted: the socket dropped at once, with nothing more sent."""
        self.reading = True
        self.high = 64 * 1024
        self.unsent = 0

    @property
    def aborted(self) -> bool:
        return self.closed

    def write(self, data: bytes) -> None:
        self.out += data
        if not self.reads:
            self.unsent += len(data)
            if self.unsent - len(data) <= self.high < self.unsent:
                self.protocol.pause_writing()

    def get_extra_info(self, name: str) -> object:
        return (self.host, 5) if name == "peername" else None

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.cut = True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is not None:
            self.high = high

    def get_write_buffer_size(self) -> int:
        return self.unsent

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def frames(self) -> list[tuple[int, int, int, bytes]]:
        """The frames written since the last call: (type, flags, stream, payload)."""
        out, pos = [], 0
        while pos < len(self.out):
            hi, lo, kind, flags, sid = struct.unpack_from(">BHBBI", self.out, pos)
            length = hi << 16 | lo
            out.append((kind, flags, sid, bytes(self.out[pos + 9 : pos + 9 + length])))
            pos += 9 + length
        self.out.clear()
        return out


REQUEST = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/svc/M"),
    (":authority", "x"),
    ("content-type", "application/grpc"),
]
"""A gRPC request's header list."""


class RecordingHandler:
    """A server connection's StreamHandler that records each stream event."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_headers(self, conn: Any, stream_id: int, headers: list[tuple[str, str]]) -> None:
        self.events.append(("headers", stream_id, dict(headers)))

    def on_data(self, conn: Any, stream_id: int, data: bytes, end: bool) -> None:
        self.events.append(("data", stream_id, data, end))

    def on_closed(self, conn: Any, stream_id: int) -> None:
        self.events.append(("closed", stream_id))

    @property
    def opened(self) -> list[int]:
        return [e[1] for e in self.events if e[0] == "headers"]

    @property
    def closed(self) -> list[int]:
        return [e[1] for e in self.events if e[0] == "closed"]


def connect(
    limits: Limits = LIMITS, budget: ProcessBudget | None = None, host: str = "127.0.0.1"
) -> tuple[Connection, FakeTransport, RecordingHandler]:
    """A server connection from `host` past its preface and SETTINGS."""
    handler, t = RecordingHandler(), FakeTransport(host=host)
    conn = Connection(handler, limits=limits, budget=budget)
    t.protocol = conn
    conn.connection_made(t)
    conn.data_received(frames.PREFACE + frames.frame(frames.SETTINGS, 0, 0, b""))
    t.frames()
    return conn, t, handler


def goaway_code(t: FakeTransport) -> int | None:
    """The error code of the GOAWAY written since the last look, if any."""
    for kind, _, _, payload in t.frames():
        if kind == frames.GOAWAY:
            return int(struct.unpack_from(">I", payload, 4)[0])
    return None
