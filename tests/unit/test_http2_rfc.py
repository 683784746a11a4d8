"""RFC 9113 sections 4-6, the server's side: what lighthouse.rpc.h2.server_connection.Connection
must do with each thing a client may not send. One row per MUST: the bytes a client sends after
its preface and SETTINGS, and the outcome the RFC asks for: ("goaway", codes) a
connection error, ("rst", stream, codes) a stream error, the connection going on,
("rst_or_goaway", stream, codes) either, where the RFC leaves the choice, ("ok",) nothing
at all. `codes` is one error code or a tuple of those accepted. No sockets: the
connection is fed bytes and its writes parsed, as in test_http2.py."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable

import hpack
import pytest

from lighthouse.rpc.h2.frames import PREFACE, frame
from lighthouse.rpc.h2.server_connection import Connection
from tests.unit.h2_fakes import REQUEST, FakeTransport, RecordingHandler

# RFC 9113's numbers (sections 6, 7 and 11), spelled out here, not taken from the code under test.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 0x8, 0x9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
PROTOCOL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED, FRAME_SIZE_ERROR = 0x1, 0x3, 0x5, 0x6
CANCEL, COMPRESSION_ERROR = 0x8, 0x9
ENABLE_PUSH, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 0x2, 0x4, 0x5
MAX_WINDOW = 2**31 - 1
TRAILERS = [("x-trailer", "1")]


def u32(value: int) -> bytes:
    return struct.pack(">I", value)


def setting(key: int, value: int) -> bytes:
    return struct.pack(">HI", key, value)


def literal(name: str, value: str) -> bytes:
    """A field as a literal not indexed (RFC 7541 6.2.2), whatever its name."""
    return bytes([0, len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


class Peer:
    """The client of one row: the server's connection past the handshake, the frames
    the server wrote since, and what the server granted (frame size, windows)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.errors = loop, list[dict]()
        loop.set_exception_handler(lambda _, context: self.errors.append(context))
        self.handler, self.t, self.enc = RecordingHandler(), FakeTransport(), hpack.Encoder()
        self.conn = Connection(self.handler)
        self.opened: set[int] = set()
        """Streams the row opened with a valid request: the handler may know them."""
        self.max_frame, self.stream_window, self.conn_window = 16_384, 65_535, 65_535
        self.stream_grants: dict[int, int] = {}
        self.frames: list[tuple[int, int, int, bytes]] = []
        self.conn.connection_made(self.t)
        self.send(PREFACE + frame(SETTINGS, 0, 0, b"") + frame(SETTINGS, ACK, 0, b""))
        self.frames.clear()

    def send(self, data: bytes) -> list[tuple[int, int, int, bytes]]:
        """Feeds `data` (data_received must never raise), and lets the loop run what
        the server left for its next turns; the frames it wrote."""
        self.conn.data_received(data)
        for _ in range(3):
            self.loop.run_until_complete(asyncio.sleep(0))
        new = self.t.frames()
        for kind, flags, sid, payload in new:
            if kind == SETTINGS and not flags & ACK:
                for pos in range(0, len(payload), 6):
                    key, value = struct.unpack_from(">HI", payload, pos)
                    if key == INITIAL_WINDOW_SIZE:
                        self.stream_window = value
                    elif key == MAX_FRAME_SIZE:
                        self.max_frame = value
            elif kind == WINDOW_UPDATE and sid:
                self.stream_grants[sid] = self.stream_grants.get(sid, 0) + u32_of(payload)
            elif kind == WINDOW_UPDATE:
                self.conn_window += u32_of(payload)
        self.frames += new
        return new

    def block(self, headers: list[tuple[str, str]] = REQUEST) -> bytes:
        return self.enc.encode(headers)

    def open(self, sid: int, end: bool = False) -> bytes:
        """A valid request's HEADERS, opening `sid` (END_STREAM with `end`)."""
        self.opened.add(sid)
        return frame(HEADERS, END_HEADERS | (END_STREAM if end else 0), sid, self.block())

    def exceed(self, streams: int) -> bytes:
        """DATA, a frame at a time so that the server's WINDOW_UPDATEs count, until one
        byte more than the server granted: on stream 1's window (streams=1), or on the
        connection's, over up to `streams` streams each within its own window."""
        sid, sent, total = 1, 0, 0
        cap = 4 * max(self.stream_window, self.conn_window)
        self.send(self.open(sid))
        while total < cap and not self.t.closed:
            left = self.stream_window + self.stream_grants.get(sid, 0) - sent
            conn_left = self.conn_window - total
            if streams > 1 and left <= 0:  # this stream's window is spent: the next one
                sid, sent = sid + 2, 0
                assert sid < 2 * streams, "the connection's window outlasted the streams"
                self.send(self.open(sid))
                continue
            size = max(1, min(self.max_frame, left + (streams == 1), conn_left + 1))
            self.send(frame(DATA, 0, sid, bytes(size)))
            sent, total = sent + size, total + size
            if size > min(left, conn_left):
                return b""
        assert self.t.closed, f"the server granted window as fast as {total} bytes came"
        return b""


def u32_of(payload: bytes) -> int:
    return int(struct.unpack(">I", payload)[0]) & MAX_WINDOW


def overpadded(data: bytes) -> bytes:
    """A PADDED frame's payload whose padding is as long as the whole payload."""
    return bytes([len(data) + 1]) + data


# fmt: off
ROWS: list[tuple[str, Callable[[Peer], bytes], tuple]] = [
    # 4.2: frame size
    ("frame-over-max-size", lambda p: frame(HEADERS, 0, 1, bytes(p.max_frame + 1)),
     ("goaway", FRAME_SIZE_ERROR)),
    ("data-over-max-size", lambda p: p.open(1) + frame(DATA, 0, 1, bytes(p.max_frame + 1)),
     ("rst_or_goaway", 1, FRAME_SIZE_ERROR)),
    ("headers-priority-too-short",
     lambda p: frame(HEADERS, END_HEADERS | PRIORITY_FLAG, 1, b"\0\0\0"),
     ("goaway", (FRAME_SIZE_ERROR, PROTOCOL_ERROR))),
    ("goaway-too-short", lambda p: frame(GOAWAY, 0, 0, u32(0)), ("goaway", FRAME_SIZE_ERROR)),
    # 6.1-6.4, 6.10: frames of a stream on stream 0
    ("data-on-stream-0", lambda p: frame(DATA, 0, 0, b"x"), ("goaway", PROTOCOL_ERROR)),
    ("headers-on-stream-0", lambda p: frame(HEADERS, END_HEADERS, 0, p.block()),
     ("goaway", PROTOCOL_ERROR)),
    ("priority-on-stream-0", lambda p: frame(PRIORITY, 0, 0, u32(1) + b"\x10"),
     ("goaway", PROTOCOL_ERROR)),
    ("rst-stream-on-stream-0", lambda p: frame(RST_STREAM, 0, 0, u32(CANCEL)),
     ("goaway", PROTOCOL_ERROR)),
    ("continuation-on-stream-0", lambda p: frame(CONTINUATION, END_HEADERS, 0, b""),
     ("goaway", PROTOCOL_ERROR)),
    # 6.5, 6.7, 6.8: frames of the connection on a stream
    ("settings-on-stream-1", lambda p: frame(SETTINGS, 0, 1, b""), ("goaway", PROTOCOL_ERROR)),
    ("ping-on-stream-1", lambda p: frame(PING, 0, 1, bytes(8)), ("goaway", PROTOCOL_ERROR)),
    ("goaway-on-stream-1", lambda p: frame(GOAWAY, 0, 1, bytes(8)), ("goaway", PROTOCOL_ERROR)),
    # 6.5: SETTINGS
    ("settings-ack-with-payload", lambda p: frame(SETTINGS, ACK, 0, setting(0x3, 1)),
     ("goaway", FRAME_SIZE_ERROR)),
    ("settings-of-7-bytes", lambda p: frame(SETTINGS, 0, 0, setting(0x3, 1) + b"\0"),
     ("goaway", FRAME_SIZE_ERROR)),
    ("settings-enable-push-2", lambda p: frame(SETTINGS, 0, 0, setting(ENABLE_PUSH, 2)),
     ("goaway", PROTOCOL_ERROR)),
    ("settings-window-over-max",
     lambda p: frame(SETTINGS, 0, 0, setting(INITIAL_WINDOW_SIZE, MAX_WINDOW + 1)),
     ("goaway", FLOW_CONTROL_ERROR)),
    ("settings-max-frame-too-small",
     lambda p: frame(SETTINGS, 0, 0, setting(MAX_FRAME_SIZE, 16_383)),
     ("goaway", PROTOCOL_ERROR)),
    ("settings-max-frame-too-large",
     lambda p: frame(SETTINGS, 0, 0, setting(MAX_FRAME_SIZE, 1 << 24)),
     ("goaway", PROTOCOL_ERROR)),
    ("settings-window-change-overflows-a-stream",  # 6.9.2
     lambda p: p.open(1) + frame(WINDOW_UPDATE, 0, 1, u32(MAX_WINDOW - 65_535))
     + frame(SETTINGS, 0, 0, setting(INITIAL_WINDOW_SIZE, 65_536)),
     ("goaway", FLOW_CONTROL_ERROR)),
    ("settings-unknown-id", lambda p: frame(SETTINGS, 0, 0, setting(0xF00D, 7)), ("ok",)),
    # 6.7: PING
    ("ping-of-7-bytes", lambda p: frame(PING, 0, 0, bytes(7)), ("goaway", FRAME_SIZE_ERROR)),
    # 6.4: RST_STREAM
    ("rst-stream-of-3-bytes", lambda p: p.open(1) + frame(RST_STREAM, 0, 1, bytes(3)),
     ("goaway", FRAME_SIZE_ERROR)),
    ("rst-stream-on-idle-stream", lambda p: frame(RST_STREAM, 0, 1, u32(CANCEL)),
     ("goaway", PROTOCOL_ERROR)),
    # 6.9: WINDOW_UPDATE
    ("window-update-of-3-bytes", lambda p: frame(WINDOW_UPDATE, 0, 0, bytes(3)),
     ("goaway", FRAME_SIZE_ERROR)),
    ("window-update-0-on-connection", lambda p: frame(WINDOW_UPDATE, 0, 0, u32(0)),
     ("goaway", PROTOCOL_ERROR)),
    ("window-update-0-on-a-stream", lambda p: p.open(1) + frame(WINDOW_UPDATE, 0, 1, u32(0)),
     ("rst_or_goaway", 1, PROTOCOL_ERROR)),
    ("window-update-on-idle-stream", lambda p: frame(WINDOW_UPDATE, 0, 1, u32(1)),
     ("goaway", PROTOCOL_ERROR)),
    ("window-update-overflows-connection",
     lambda p: frame(WINDOW_UPDATE, 0, 0, u32(MAX_WINDOW)),
     ("goaway", FLOW_CONTROL_ERROR)),
    ("window-update-overflows-a-stream",
     lambda p: p.open(1) + frame(WINDOW_UPDATE, 0, 1, u32(MAX_WINDOW)),
     ("rst", 1, FLOW_CONTROL_ERROR)),
    # 6.3, 5.3.1: PRIORITY
    ("priority-of-4-bytes", lambda p: p.open(1) + frame(PRIORITY, 0, 1, bytes(4)),
     ("rst", 1, FRAME_SIZE_ERROR)),
    ("priority-on-itself", lambda p: p.open(1) + frame(PRIORITY, 0, 1, u32(1) + b"\x10"),
     ("rst_or_goaway", 1, PROTOCOL_ERROR)),
    ("headers-priority-on-itself",
     lambda p: frame(HEADERS, END_HEADERS | PRIORITY_FLAG, 1, u32(1) + b"\x10" + p.block()),
     ("rst_or_goaway", 1, PROTOCOL_ERROR)),
    ("priority-on-idle-stream", lambda p: frame(PRIORITY, 0, 3, u32(0) + b"\x10"), ("ok",)),
    # 6.1, 6.2: padding
    ("data-padding-fills-the-frame",
     lambda p: p.open(1) + frame(DATA, PADDED, 1, overpadded(b"abc")),
     ("goaway", PROTOCOL_ERROR)),
    ("headers-padding-fills-the-frame",
     lambda p: frame(HEADERS, END_HEADERS | PADDED, 1, overpadded(p.block())),
     ("goaway", PROTOCOL_ERROR)),
    ("headers-padded-and-empty", lambda p: frame(HEADERS, END_HEADERS | PADDED, 1, b""),
     ("goaway", (PROTOCOL_ERROR, FRAME_SIZE_ERROR))),
    ("data-padded-and-empty", lambda p: p.open(1) + frame(DATA, PADDED, 1, b""),
     ("goaway", (PROTOCOL_ERROR, FRAME_SIZE_ERROR))),
    # 6.2, 6.10: header blocks
    ("ping-inside-a-header-block",
     lambda p: frame(HEADERS, 0, 1, p.block()) + frame(PING, 0, 0, bytes(8)),
     ("goaway", PROTOCOL_ERROR)),
    ("continuation-on-another-stream",
     lambda p: frame(HEADERS, 0, 1, p.block()) + frame(CONTINUATION, END_HEADERS, 3, b""),
     ("goaway", PROTOCOL_ERROR)),
    ("continuation-without-headers", lambda p: frame(CONTINUATION, END_HEADERS, 1, p.block()),
     ("goaway", PROTOCOL_ERROR)),
    ("continuation-after-end-headers",
     lambda p: p.open(1) + frame(CONTINUATION, END_HEADERS, 1, b""),
     ("goaway", PROTOCOL_ERROR)),
    # 5.1, 5.1.1, 8.1: stream states and identifiers
    ("headers-on-even-stream", lambda p: frame(HEADERS, END_HEADERS, 2, p.block()),
     ("goaway", PROTOCOL_ERROR)),
    ("stream-id-lower-than-one-opened",
     lambda p: p.open(5, end=True) + frame(HEADERS, END_HEADERS, 3, p.block()),
     ("goaway", PROTOCOL_ERROR)),
    ("data-on-idle-stream", lambda p: frame(DATA, 0, 1, b"x"), ("goaway", PROTOCOL_ERROR)),
    ("data-on-half-closed-stream",
     lambda p: p.open(1, end=True) + frame(DATA, END_STREAM, 1, bytes(5)),
     ("rst_or_goaway", 1, STREAM_CLOSED)),
    ("headers-on-half-closed-stream",
     lambda p: p.open(1, end=True) + frame(HEADERS, END_HEADERS | END_STREAM, 1, p.block(TRAILERS)),
     ("rst_or_goaway", 1, STREAM_CLOSED)),
    ("data-after-rst-stream",
     lambda p: p.open(1) + frame(RST_STREAM, 0, 1, u32(CANCEL)) + frame(DATA, 0, 1, bytes(5)),
     ("rst_or_goaway", 1, STREAM_CLOSED)),
    ("second-headers-without-end-stream",
     lambda p: p.open(1) + frame(HEADERS, END_HEADERS, 1, p.block(TRAILERS)),
     ("rst_or_goaway", 1, PROTOCOL_ERROR)),
    ("trailers-end-the-stream",
     lambda p: p.open(1) + frame(DATA, 0, 1, bytes(5))
     + frame(HEADERS, END_HEADERS | END_STREAM, 1, p.block(TRAILERS)),
     ("ok",)),
    # 6.9.1: flow control, against the windows the server advertised
    ("data-over-the-stream-window", lambda p: p.exceed(streams=1),
     ("rst_or_goaway", 1, FLOW_CONTROL_ERROR)),
    ("data-over-the-connection-window", lambda p: p.exceed(streams=100),
     ("goaway", FLOW_CONTROL_ERROR)),
    # 8.4, 4.3, 8.2.1, 8.3: what a request may carry
    ("push-promise-from-a-client",
     lambda p: p.open(1) + frame(PUSH_PROMISE, END_HEADERS, 1, u32(2)),
     ("goaway", PROTOCOL_ERROR)),
    ("bad-hpack", lambda p: frame(HEADERS, END_HEADERS, 1, b"\xbe"),  # index 62: table empty
     ("goaway", COMPRESSION_ERROR)),
    ("empty-header-name", lambda p: frame(HEADERS, END_HEADERS, 1, p.block() + literal("", "x")),
     ("rst_or_goaway", 1, PROTOCOL_ERROR)),
    ("upper-case-header-name",
     lambda p: frame(HEADERS, END_HEADERS, 1, p.block() + literal("X-Upper", "x")),
     ("rst_or_goaway", 1, PROTOCOL_ERROR)),
    ("pseudo-header-after-regular",
     lambda p: frame(HEADERS, END_HEADERS, 1, p.block([REQUEST[-1], *REQUEST[:-1]])),
     ("rst_or_goaway", 1, PROTOCOL_ERROR)),
    # 4.1, 5.5: extensions
    ("unknown-frame-type", lambda p: frame(0xFA, 0xFF, 0, b"whatever") + frame(0xFB, 0, 1, b""),
     ("ok",)),
]
# fmt: on


@pytest.fixture
def peer():
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield Peer(loop)
    asyncio.set_event_loop(None)
    loop.close()


@pytest.mark.parametrize("build, outcome", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_the_server_answers_what_rfc_9113_asks(peer, build, outcome):
    peer.send(build(peer))
    assert not peer.errors, peer.errors  # nor what it left for the loop
    codes = outcome[-1] if isinstance(outcome[-1], tuple) else (outcome[-1],)
    goaways = [u32_of(f[3][4:8]) for f in peer.frames if f[0] == GOAWAY]
    resets = [(f[2], u32_of(f[3])) for f in peer.frames if f[0] == RST_STREAM]
    kind = outcome[0]
    if kind == "rst_or_goaway":
        kind = "goaway" if goaways or peer.t.closed else "rst"
    # A request the server refuses, the stream's or the connection's, never reaches it.
    seen = {e[1] for e in peer.handler.events if e[0] == "headers"}
    if kind != "ok":
        assert seen <= peer.opened, f"the handler saw streams {seen - peer.opened}"
    if kind == "goaway":
        assert goaways and goaways[-1] in codes, f"GOAWAY codes {goaways}, resets {resets}"
        assert peer.t.closed
        return
    assert not goaways and not peer.t.closed, f"GOAWAY codes {goaways}"
    if kind == "rst":
        assert any(sid == outcome[1] and code in codes for sid, code in resets), resets
    else:
        assert not resets, resets
    # The connection goes on.
    assert (PING, ACK, 0, b"still on") in peer.send(frame(PING, 0, 0, b"still on"))
