"""Our client connection (lighthouse.rpc.h2.client_connection, lean.client_calls)
against a server that breaks the rules or sends too much: a connection fed
bytes through a fake transport, its writes parsed (no sockets). Each row:
what the server sends while a unary call (stream 1) and a streaming call
(stream 3) are open, and the outcome: ("aborted", code, pattern) the connection
aborted with GOAWAY `code`, both calls Unavailable with a reason matching `pattern`;
("failed", stream, status, end) that call failed with `status`, and was reset unless the
server ended it, the other goes on; ("fine", answer) the unary call answered `answer`,
the stream goes on."""

from __future__ import annotations

import asyncio
import re
import struct
from collections.abc import Callable

import grpc
import pytest

from lighthouse.rpc.h2 import client_connection
from lighthouse.rpc.h2.client_connection import (
    KEEPALIVE_S,
    MAX_CONTINUATIONS,
    MAX_FRAME,
    MAX_HEADER_BLOCK,
    MAX_SETTINGS,
    MAX_WRITE_BUFFER,
    NO_WORK_RATE,
    PING_RATE,
    PING_TIMEOUT_S,
    RECV_WINDOW,
    SETTINGS_RATE,
    Unavailable,
)
from lighthouse.rpc.h2.frames import (
    ACK,
    CANCEL,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    ERROR_NAMES,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    PADDED,
    PING,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    encode_int,
    frame,
    literal,
)
from lighthouse.rpc.lean.client_calls import MAX_MESSAGE_BYTES, CallFailed, GrpcConnection
from tests.unit.h2_fakes import FakeTransport
from tests.unit.virtual_clock import VirtualClockLoop

RESPONSE = literal(":status", "200") + literal("content-type", "application/grpc")
OK = literal("grpc-status", "0")
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def message(body: bytes, declared: int | None = None) -> bytes:
    return struct.pack(">BI", 0, len(body) if declared is None else declared) + body


def data(sid: int, payload: bytes, flags: int = 0) -> bytes:
    """`payload` in DATA frames of the largest size we accept."""
    step = range(0, max(len(payload), 1), MAX_FRAME)
    return b"".join(frame(DATA, flags, sid, payload[i : i + MAX_FRAME]) for i in step)


def answer(sid: int, body: bytes = b"ok") -> bytes:
    return (
        frame(HEADERS, END_HEADERS, sid, RESPONSE)
        + data(sid, message(body))
        + frame(HEADERS, END_HEADERS | END_STREAM, sid, OK)
    )


def u32(value: int) -> bytes:
    return struct.pack(">I", value)


def flood(frames: bytes, rate: tuple[float, float]) -> bytes:
    """Twice a rate's burst of `frames`: past it however slow the test runs."""
    return frames * int(2 * rate[0])


NO_WORK = int(2 * NO_WORK_RATE[0])


def empty_continuations() -> bytes:
    """Header blocks of MAX_CONTINUATIONS frames each, all empty but the first."""
    block = frame(HEADERS, 0, 1, RESPONSE) + frame(CONTINUATION, 0, 1, b"") * (
        MAX_CONTINUATIONS - 1
    )
    return (block + frame(CONTINUATION, END_HEADERS, 1, b"")) * (NO_WORK // MAX_CONTINUATIONS)


def oversized_header_list() -> bytes:
    """A small block that decodes large: one 3,000-byte field added to the
    table (RFC 7541 6.2.1), then named again five times by its index, 62."""
    value = b"v" * 3000
    added = b"\x40" + encode_int(5, 7) + b"x-big" + encode_int(len(value), 7) + value
    return frame(HEADERS, END_HEADERS, 1, added + b"\xbe" * 5)


class Peer:
    """A GrpcConnection past the handshake, with a unary call on stream 1
    and a streaming call on stream 3 (must be made on a running loop)."""

    def __init__(self, reads: bool = True) -> None:
        self.conn = GrpcConnection()
        self.t = FakeTransport(self.conn, reads)
        self.conn.connection_made(self.t)
        self.conn.data_received(frame(SETTINGS, 0, 0, b"") + frame(SETTINGS, ACK, 0, b""))
        _, self.unary = self.conn.start(b"", b"request")
        self.messages: list[bytes] = []
        _, self.stream = self.conn.open_stream(b"", self.messages.append)
        self.t.frames()


# fmt: off
ROWS: list[tuple[str, Callable[[], bytes], tuple]] = [
    # Sizes: frames, header blocks before and after decoding, messages.
    ("frame-over-16k", lambda: frame(DATA, 0, 1, bytes(MAX_FRAME + 1)),
     ("aborted", FRAME_SIZE_ERROR, "a frame of 16385 bytes")),
    ("frame-header-of-16m-alone", lambda: struct.pack(">BHBBI", 0xFF, 0xFFFF, DATA, 0, 1),
     ("aborted", FRAME_SIZE_ERROR, "a frame of 16777215 bytes")),
    ("header-block-over-16k",
     lambda: frame(HEADERS, 0, 1, bytes(10_000))
     + frame(CONTINUATION, END_HEADERS, 1, bytes(MAX_HEADER_BLOCK - 9_999)),
     ("aborted", ENHANCE_YOUR_CALM, "header block over the limit")),
    ("header-list-over-16k", oversized_header_list,
     ("aborted", COMPRESSION_ERROR, "header list larger than 16384")),
    ("answer-over-4m",
     lambda: frame(HEADERS, END_HEADERS, 1, RESPONSE)
     + data(1, message(bytes(MAX_MESSAGE_BYTES + 1))),
     ("failed", 1, EXHAUSTED, "reset")),
    ("answer-over-4m-past-its-declared-size",
     lambda: frame(HEADERS, END_HEADERS, 1, RESPONSE)
     + data(1, message(bytes(10)) + bytes(MAX_MESSAGE_BYTES)),
     ("failed", 1, EXHAUSTED, "reset")),
    ("answer-declared-over-4m-cut-short",
     lambda: frame(HEADERS, END_HEADERS, 1, RESPONSE)
     + frame(DATA, 0, 1, message(b"x", MAX_MESSAGE_BYTES + 1))
     + frame(HEADERS, END_HEADERS | END_STREAM, 1, OK),
     ("failed", 1, EXHAUSTED, "ended")),
    ("stream-message-declared-over-4m", lambda: frame(DATA, 0, 3, message(b"", 2**32 - 1)),
     ("failed", 3, EXHAUSTED, "reset")),
    ("answer-of-4m", lambda: answer(1, bytes(MAX_MESSAGE_BYTES)),
     ("fine", bytes(MAX_MESSAGE_BYTES))),
    # Malformed frames.
    ("padded-data-empty", lambda: frame(DATA, PADDED, 1, b""),
     ("aborted", PROTOCOL_ERROR, "padding")),
    ("padded-data-padding-too-long", lambda: frame(DATA, PADDED, 1, b"\x04abc"),
     ("aborted", PROTOCOL_ERROR, "padding")),
    ("padded-headers-empty", lambda: frame(HEADERS, END_HEADERS | PADDED, 1, b""),
     ("aborted", PROTOCOL_ERROR, "padding")),
    ("padded-headers-padding-too-long",
     lambda: frame(HEADERS, END_HEADERS | PADDED, 1, bytes([len(RESPONSE) + 1]) + RESPONSE),
     ("aborted", PROTOCOL_ERROR, "padding")),
    ("priority-headers-too-short", lambda: frame(HEADERS, END_HEADERS | PRIORITY_FLAG, 1, b"\0"),
     ("aborted", FRAME_SIZE_ERROR, "priority")),
    ("settings-of-7-bytes", lambda: frame(SETTINGS, 0, 0, bytes(7)),
     ("aborted", FRAME_SIZE_ERROR, "SETTINGS frame of 7 bytes")),
    ("settings-ack-with-payload", lambda: frame(SETTINGS, ACK, 0, bytes(6)),
     ("aborted", FRAME_SIZE_ERROR, "SETTINGS frame of 6 bytes")),
    ("settings-window-over-max", lambda: frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 2**31)),
     ("aborted", FLOW_CONTROL_ERROR, "initial window")),
    ("ping-of-7-bytes", lambda: frame(PING, 0, 0, bytes(7)),
     ("aborted", FRAME_SIZE_ERROR, "of 7 bytes, not 8")),
    ("window-update-of-3-bytes", lambda: frame(WINDOW_UPDATE, 0, 0, bytes(3)),
     ("aborted", FRAME_SIZE_ERROR, "of 3 bytes, not 4")),
    ("window-update-of-0", lambda: frame(WINDOW_UPDATE, 0, 3, u32(0)),
     ("aborted", PROTOCOL_ERROR, "WINDOW_UPDATE of 0")),
    ("window-update-over-max", lambda: frame(WINDOW_UPDATE, 0, 0, u32(2**31 - 1)),
     ("aborted", FLOW_CONTROL_ERROR, "window over")),
    ("rst-stream-of-3-bytes", lambda: frame(RST_STREAM, 0, 1, bytes(3)),
     ("aborted", FRAME_SIZE_ERROR, "of 3 bytes, not 4")),
    ("goaway-of-4-bytes", lambda: frame(GOAWAY, 0, 0, bytes(4)),
     ("aborted", FRAME_SIZE_ERROR, "GOAWAY frame of 4 bytes")),
    ("bad-hpack", lambda: frame(HEADERS, END_HEADERS, 1, b"\xbf\x7f"),
     ("aborted", COMPRESSION_ERROR, "header block")),
    ("ping-inside-a-header-block",
     lambda: frame(HEADERS, 0, 1, RESPONSE) + frame(PING, 0, 0, bytes(8)),
     ("aborted", PROTOCOL_ERROR, "inside a header block")),
    ("continuation-without-headers", lambda: frame(CONTINUATION, END_HEADERS, 1, RESPONSE),
     ("aborted", PROTOCOL_ERROR, "CONTINUATION without")),
    ("push-promise", lambda: frame(PUSH_PROMISE, END_HEADERS, 1, u32(2) + RESPONSE),
     ("aborted", PROTOCOL_ERROR, "PUSH_PROMISE")),
    ("data-on-a-stream-never-opened", lambda: frame(DATA, 0, 5, message(b"x")),
     ("aborted", PROTOCOL_ERROR, "DATA on stream 5")),
    ("headers-on-stream-0", lambda: frame(HEADERS, END_HEADERS, 0, RESPONSE),
     ("aborted", PROTOCOL_ERROR, "HEADERS on stream 0")),
    # What a server may send.
    ("padded-answer",
     lambda: frame(HEADERS, END_HEADERS | PADDED | PRIORITY_FLAG, 1,
                   b"\x02" + u32(0) + b"\x10" + RESPONSE + b"\0\0")
     + frame(DATA, PADDED, 1, b"\x03" + message(b"ok") + b"\0\0\0")
     + frame(HEADERS, END_HEADERS | END_STREAM, 1, OK),
     ("fine", b"ok")),
    ("answer-in-continuations",
     lambda: frame(HEADERS, 0, 1, RESPONSE[:3]) + frame(CONTINUATION, END_HEADERS, 1, RESPONSE[3:])
     + frame(DATA, 0, 1, message(b"ok")) + frame(HEADERS, END_STREAM, 1, b"")
     + frame(CONTINUATION, END_HEADERS, 1, OK),
     ("fine", b"ok")),
    ("unknown-frames-priority-and-pings",
     lambda: frame(0xFA, 0xFF, 1, b"?") + frame(PRIORITY, 0, 1, u32(0) + b"\x10")
     + frame(PING, 0, 0, bytes(8)) + frame(SETTINGS, 0, 0, struct.pack(">HI", 0xF00D, 1)),
     ("fine", b"ok")),
    ("a-burst-of-each-no-work-frame",
     lambda: (frame(PRIORITY, 0, 1, u32(0) + b"\x10") + frame(DATA, 0, 1, b"")
              + frame(WINDOW_UPDATE, 0, 0, u32(1)) + frame(PING, ACK, 0, bytes(8))) * 100
     + frame(HEADERS, 0, 3, RESPONSE) + frame(CONTINUATION, 0, 3, b"") * (MAX_CONTINUATIONS - 1)
     + frame(CONTINUATION, END_HEADERS, 3, b"")
     + frame(PING, 0, 0, bytes(8)) * 100 + frame(SETTINGS, 0, 0, bytes(6 * MAX_SETTINGS)) * 20,
     ("fine", b"ok")),
    # Work without bytes: frames that do nothing, past their rates (issue 48).
    ("empty-continuations-in-one-block",
     lambda: frame(HEADERS, 0, 1, RESPONSE) + frame(CONTINUATION, 0, 1, b"") * 100_000,
     ("aborted", ENHANCE_YOUR_CALM, "a header block in too many frames")),
    ("empty-continuations-in-many-blocks", empty_continuations,
     ("aborted", ENHANCE_YOUR_CALM, "too many empty CONTINUATION frames")),
    ("empty-data-without-end-stream", lambda: frame(DATA, 0, 1, b"") * NO_WORK,
     ("aborted", ENHANCE_YOUR_CALM, "too many empty DATA frames")),
    ("priority-flood", lambda: frame(PRIORITY, 0, 1, u32(0) + b"\x10") * NO_WORK,
     ("aborted", ENHANCE_YOUR_CALM, f"too many frames of type {PRIORITY}")),
    ("unknown-frame-flood", lambda: frame(0xFA, 0, 0, b"") * NO_WORK,
     ("aborted", ENHANCE_YOUR_CALM, "too many frames of type 250")),
    ("unasked-ping-acks", lambda: frame(PING, ACK, 0, bytes(8)) * NO_WORK,
     ("aborted", ENHANCE_YOUR_CALM, f"too many frames of type {PING}")),
    ("unasked-acks-of-our-keepalive", lambda: frame(PING, ACK, 0, b"keepaliv") * NO_WORK,
     ("aborted", ENHANCE_YOUR_CALM, f"too many frames of type {PING}")),
    ("unasked-settings-acks", lambda: frame(SETTINGS, ACK, 0, b"") * NO_WORK,
     ("aborted", ENHANCE_YOUR_CALM, f"too many frames of type {SETTINGS}")),
    ("window-update-plus-1-flood", lambda: frame(WINDOW_UPDATE, 0, 0, u32(1)) * NO_WORK,
     ("aborted", ENHANCE_YOUR_CALM, "too many WINDOW_UPDATE frames past the data we sent")),
    ("stream-window-update-flood", lambda: frame(WINDOW_UPDATE, 0, 3, u32(1)) * NO_WORK,
     ("aborted", ENHANCE_YOUR_CALM, "too many WINDOW_UPDATE frames past the data we sent")),
    ("ping-flood", lambda: flood(frame(PING, 0, 0, bytes(8)), PING_RATE),
     ("aborted", ENHANCE_YOUR_CALM, "too many PINGs")),
    ("settings-flood", lambda: flood(frame(SETTINGS, 0, 0, b""), SETTINGS_RATE),
     ("aborted", ENHANCE_YOUR_CALM, "too many SETTINGS frames")),
    ("settings-of-2730-entries", lambda: frame(SETTINGS, 0, 0, bytes(6 * 2730)),
     ("aborted", ENHANCE_YOUR_CALM, f"over {MAX_SETTINGS} SETTINGS entries")),
    ("rst-stream-on-a-stream-never-opened", lambda: frame(RST_STREAM, 0, 5, u32(CANCEL)),
     ("aborted", PROTOCOL_ERROR, "RST_STREAM on stream 5")),
]
# fmt: on


@pytest.mark.parametrize("build, outcome", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_what_the_server_sends_is_bounded_and_checked(build, outcome):
    async def scenario() -> None:
        p = Peer()
        p.conn.data_received(build())  # never raises
        frames = p.t.frames()
        goaways = [struct.unpack(">I", f[3][4:8])[0] for f in frames if f[0] == GOAWAY]
        if outcome[0] == "aborted":
            _, code, pattern = outcome
            assert p.t.aborted and goaways == [code]
            for call in (p.unary, p.stream):
                error = call.done.exception()
                assert isinstance(error, Unavailable), error
                assert re.search(rf"\({ERROR_NAMES[code]}\): .*{pattern}", str(error)), str(error)
            return
        assert not p.t.aborted and not goaways, p.unary.done
        if 1 in p.conn.calls:
            p.conn.data_received(answer(1))
        if 3 in p.conn.calls:
            p.conn.data_received(frame(DATA, 0, 3, message(b"hi")))
        assert not p.t.aborted
        if outcome[0] == "failed":
            _, sid, status, end = outcome
            error = (p.unary if sid == 1 else p.stream).done.exception()
            assert isinstance(error, CallFailed) and error.code == status, error
            assert "larger than max" in error.details
            assert ((RST_STREAM, 0, sid, u32(CANCEL)) in frames) is (end == "reset")
            if sid == 1:
                assert p.messages == [b"hi"]
            else:
                assert p.unary.done.result() == b"ok"
        else:
            assert p.unary.done.result() == outcome[1]
            assert p.messages == [b"hi"] and not p.stream.done.done()

    asyncio.run(scenario())


def window_updates(frames: list[tuple[int, int, int, bytes]]) -> list[tuple[int, int]]:
    return [(sid, struct.unpack(">I", p)[0]) for kind, _, sid, p in frames if kind == WINDOW_UPDATE]


def test_windows_come_back_as_messages_are_taken_not_as_bytes_arrive():
    big = message(bytes(MAX_MESSAGE_BYTES))  # half our window: its end gives the window back

    async def scenario() -> None:
        p = Peer()
        half = len(big) // 2
        # A unary answer: held until it ends, then given back at once.
        p.conn.data_received(frame(HEADERS, END_HEADERS, 1, RESPONSE) + data(1, big[:half]))
        p.conn.data_received(data(1, big[half:]))
        assert window_updates(p.t.frames()) == []
        p.conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 1, OK))
        assert p.unary.done.result() == bytes(MAX_MESSAGE_BYTES)
        assert window_updates(p.t.frames()) == [(0, len(big))]
        # A stream's message: given back, to the stream and the connection, once taken.
        p.conn.data_received(data(3, big[:half]))
        assert window_updates(p.t.frames()) == [] and p.messages == []
        p.conn.data_received(data(3, big[half:]))
        assert p.messages == [bytes(MAX_MESSAGE_BYTES)]
        assert window_updates(p.t.frames()) == [(3, len(big)), (0, len(big))]
        # A call that ends while holding bytes gives them back, as do bytes dropped.
        p.conn.start(b"", b"request")
        p.conn.data_received(data(5, big[:-1]))
        p.t.frames()
        p.conn.cancel(5)
        assert [k for k, *_ in p.t.frames()] == [RST_STREAM]
        p.conn.data_received(frame(DATA, 0, 5, b"x"))  # in flight when we reset it
        assert window_updates(p.t.frames()) == [(0, len(big))]

    assert len(big) == RECV_WINDOW // 2
    asyncio.run(scenario())


def test_a_server_that_asks_for_answers_and_reads_none_is_dropped(monkeypatch):
    monkeypatch.setattr(client_connection, "PING_RATE", (1e9, 1e9))  # the rate comes first

    async def scenario() -> None:
        p = Peer(reads=False)
        pings = frame(PING, 0, 0, bytes(8)) * 1000
        for _ in range(1000):
            p.conn.data_received(pings)
            if p.t.aborted:
                break
        acks = len(pings) * 17 // 9  # one read's answers: a PING ACK is 17 bytes
        assert p.t.aborted and p.t.unsent <= MAX_WRITE_BUFFER + acks
        error = p.unary.done.exception()
        assert isinstance(error, Unavailable) and "not taken by the server" in str(error)
        p.t.frames()
        p.conn.data_received(pings)  # what was in flight: nothing more is written
        assert p.t.frames() == []

    asyncio.run(scenario())


ENDED = [
    ("rst-stream", frame(RST_STREAM, 0, 1, u32(CANCEL)), "RST_STREAM frames on ended calls"),
    ("headers", frame(HEADERS, END_HEADERS, 1, OK), "HEADERS frames on ended calls"),
    ("goaway", frame(GOAWAY, 0, 0, u32(3) + u32(0)), "GOAWAY frames"),
]


@pytest.mark.parametrize("one, pattern", [r[1:] for r in ENDED], ids=[r[0] for r in ENDED])
def test_frames_on_an_ended_call_are_no_work_past_their_rate(one, pattern):
    """The unary call answered, a flood on it (or of GOAWAYs) ends the
    connection, and the stream still open on it fails Unavailable."""

    async def scenario() -> None:
        p = Peer()
        p.conn.data_received(answer(1) + one * 10)  # one crossing our reset: fine
        assert p.unary.done.result() == b"ok" and not p.t.aborted
        p.conn.data_received(one * NO_WORK)
        goaways = [struct.unpack(">I", f[3][4:8])[0] for f in p.t.frames() if f[0] == GOAWAY]
        assert p.t.aborted and goaways == [ENHANCE_YOUR_CALM]
        error = p.stream.done.exception()
        assert isinstance(error, Unavailable) and f"too many {pattern}" in str(error), error

    asyncio.run(scenario())


def goaway(last: int) -> bytes:
    return frame(GOAWAY, 0, 0, u32(last) + u32(0))


def test_a_connection_the_server_sent_goaway_on_is_closed_once_its_last_call_ends():
    async def scenario() -> None:
        # GOAWAY with both calls under its last stream: they go on; closed after the last.
        p = Peer()
        p.conn.data_received(goaway(3) + answer(1))
        assert p.unary.done.result() == b"ok" and not p.t.closed
        with pytest.raises(Unavailable, match="no open connection"):
            p.conn.start(b"", b"another")
        p.conn.data_received(frame(DATA, 0, 3, message(b"hi")))
        assert p.messages == [b"hi"] and not p.t.closed
        p.conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 3, OK))
        assert p.stream.done.result() == b"" and p.t.closed
        assert GOAWAY not in [f[0] for f in p.t.frames()]  # closed, not broken
        # The call the GOAWAY leaves out fails; the other's answer closes it.
        p = Peer()
        p.conn.data_received(goaway(1))
        assert "going away" in str(p.stream.done.exception()) and not p.t.closed
        p.conn.data_received(answer(1))
        assert p.unary.done.result() == b"ok" and p.t.closed
        # Answered first, then GOAWAY: closed at once. Cancelled: closed too.
        p = Peer()
        p.conn.cancel(3)
        p.conn.data_received(answer(1) + goaway(1))
        assert p.t.closed
        p = Peer()
        p.conn.data_received(goaway(3))
        p.conn.cancel(1)
        assert not p.t.closed
        p.conn.cancel(3)
        assert p.t.closed and [f[0] for f in p.t.frames()] == [RST_STREAM, RST_STREAM]

    asyncio.run(scenario())


def pings(frames: list[tuple[int, int, int, bytes]]) -> list[bytes]:
    return [f[3] for f in frames if f[0] == PING and not f[1] & ACK]


def test_a_silent_server_is_pinged_and_dropped_without_an_answer():
    """On a virtual clock: with calls open, silence for KEEPALIVE_S gets a
    PING; an answer (any frame) keeps the connection, none within
    PING_TIMEOUT_S ends it. Without calls, no timer and no PING."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        p = Peer()
        await asyncio.sleep(KEEPALIVE_S * 3)
        assert len(pings(p.t.frames())) == 1 and p.t.aborted  # one PING, no answer
        error = p.unary.done.exception()
        assert isinstance(error, Unavailable) and "of our PING" in str(error), error

        p = Peer()
        start = loop.time()
        await asyncio.sleep(KEEPALIVE_S + 0.5)  # silence: the PING is out
        sent = pings(p.t.frames())
        assert len(sent) == 1 and not p.t.aborted
        p.conn.data_received(frame(PING, ACK, 0, sent[0]))
        await asyncio.sleep(PING_TIMEOUT_S)
        assert not p.t.aborted
        for _ in range(10):  # a server that talks is never pinged
            await asyncio.sleep(KEEPALIVE_S / 2)
            p.conn.data_received(frame(DATA, 0, 3, message(b"hi")))
        assert pings(p.t.frames()) == [] and not p.t.aborted
        assert loop.time() - start > 6 * KEEPALIVE_S
        p.conn.data_received(answer(1) + frame(HEADERS, END_HEADERS | END_STREAM, 3, OK))
        await asyncio.sleep(KEEPALIVE_S * 10)  # no call open: nothing to ask
        assert pings(p.t.frames()) == [] and not p.t.aborted

    loop = VirtualClockLoop()
    try:
        loop.run_until_complete(scenario())
    finally:
        loop.close()
