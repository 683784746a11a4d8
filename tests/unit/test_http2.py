"""lighthouse.rpc.h2.server_connection frame by frame: a connection fed bytes,
its writes parsed (no sockets)."""

from __future__ import annotations

import asyncio
import struct
import threading

import hpack
import pytest

from lighthouse.rpc.h2 import corking
from lighthouse.rpc.h2 import frames as http2
from lighthouse.rpc.h2.frames import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)
from lighthouse.rpc.h2.limits import LIMITS
from lighthouse.rpc.h2.server_connection import Connection
from tests.unit.h2_fakes import REQUEST, FakeTransport, RecordingHandler


@pytest.fixture
def conn():
    """A connection past the preface and the client's (empty) SETTINGS."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    handler = RecordingHandler()
    c = Connection(handler)
    t = FakeTransport()
    c.connection_made(t)
    c.data_received(http2.PREFACE + frame(SETTINGS, 0, 0, b""))
    c.handler, c.t, c.enc = handler, t, hpack.Encoder()
    yield c
    asyncio.set_event_loop(None)
    loop.close()


def test_the_server_speaks_first_then_acknowledges_the_clients_settings(conn):
    kinds = [(k, f, sid) for k, f, sid, _ in conn.t.frames()]
    assert kinds == [(SETTINGS, 0, 0), (WINDOW_UPDATE, 0, 0), (SETTINGS, http2.ACK, 0)]


def test_a_request_split_over_continuation_frames_with_padding_arrives_whole(conn):
    conn.t.frames()
    block = conn.enc.encode(REQUEST)
    padded = bytes([3]) + block[:5] + b"\0\0\0"
    conn.data_received(
        frame(HEADERS, http2.PADDED, 1, padded)
        + frame(CONTINUATION, END_HEADERS, 1, block[5:])
        + frame(DATA, END_STREAM, 1, b"abc")
    )
    assert conn.handler.events == [
        ("headers", 1, dict(REQUEST)),
        ("data", 1, b"abc", True),
    ]


@pytest.mark.parametrize(
    "payload, closed",
    [
        (b"GET / HTTP/1.1\r\n\r\n", True),  # not HTTP/2
        (frame(PING, 0, 0, b"12345678"), False),  # answered
        (frame(DATA, 0, 7, b"x"), True),  # data on a stream never opened
        (frame(HEADERS, END_HEADERS, 2, b""), True),  # client streams are odd
        (frame(SETTINGS, 0, 0, b"\0\4\0"), True),  # not a whole setting
        (frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\x0f"), True),  # bad HPACK
    ],
    ids=["http1", "ping", "idle-data", "even-stream", "short-settings", "bad-hpack"],
)
def test_protocol_errors_close_with_goaway_and_pings_are_echoed(payload, closed):
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        c, t = Connection(RecordingHandler()), FakeTransport()
        c.connection_made(t)
        c.data_received((b"" if payload.startswith(b"GET") else http2.PREFACE) + payload)
        frames = t.frames()
        assert t.closed is closed
        assert (frames[-1][0] == GOAWAY) is closed
        if not closed:
            assert frames[-1] == (PING, http2.ACK, 0, b"12345678")
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def test_data_beyond_the_peers_window_waits_for_its_window_update(conn):
    conn.data_received(frame(SETTINGS, 0, 0, struct.pack(">HI", 0x4, 10)))  # 10-byte windows
    conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 1, conn.enc.encode(REQUEST)))
    conn.t.frames()
    conn.send(1, b"H", b"0123456789abcdef", b"T")
    assert [(k, p) for k, _, _, p in conn.t.frames()] == [(HEADERS, b"H"), (DATA, b"0123456789")]
    assert conn.is_open(1)
    conn.data_received(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 100)))
    out = conn.t.frames()
    assert [(k, f, p) for k, f, _, p in out] == [
        (DATA, 0, b"abcdef"),
        (HEADERS, END_HEADERS | END_STREAM, b"T"),
    ]
    assert not conn.is_open(1)


def test_a_message_larger_than_the_peers_frame_size_goes_in_several_frames(conn):
    conn.data_received(frame(SETTINGS, 0, 0, struct.pack(">HI", 0x4, 1 << 20)))
    conn.data_received(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 20)))
    conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 1, conn.enc.encode(REQUEST)))
    conn.t.frames()
    conn.send(1, None, bytes(40_000), b"T")
    sizes = [(k, len(p)) for k, _, _, p in conn.t.frames()]
    assert sizes == [(DATA, 16_384), (DATA, 16_384), (DATA, 7_232), (HEADERS, 1)]


def test_rst_stream_and_a_lost_connection_close_the_handlers_streams(conn):
    for sid in (1, 3):
        conn.data_received(frame(HEADERS, END_HEADERS, sid, conn.enc.encode(REQUEST)))
    conn.data_received(frame(RST_STREAM, 0, 1, struct.pack(">I", http2.CANCEL)))
    conn.send(1, b"H", b"late", b"T")  # a closed stream sends nothing
    assert [k for k, *_ in conn.t.frames()] == [SETTINGS, WINDOW_UPDATE, SETTINGS]
    conn.connection_lost(None)
    assert [e for e in conn.handler.events if e[0] == "closed"] == [("closed", 1), ("closed", 3)]


def test_windows_come_back_as_the_handler_consumes_not_as_bytes_arrive(conn):
    conn.data_received(frame(HEADERS, END_HEADERS, 1, conn.enc.encode(REQUEST)))
    conn.t.frames()
    chunk = bytes(LIMITS.max_frame)
    for _ in range(3):
        conn.data_received(frame(DATA, 0, 1, chunk))
    assert conn.t.frames() == []  # held by the handler: nothing given back
    conn.consumed(1, 3 * len(chunk))
    updates = [(sid, struct.unpack(">I", p)[0]) for k, _, sid, p in conn.t.frames()]
    assert updates == [(1, 3 * len(chunk))]
    # What is held stays bounded: past the window is a stream error, not a buffer.
    for _ in range(3):
        conn.data_received(frame(DATA, 0, 1, chunk))
    conn.data_received(frame(DATA, 0, 1, chunk))
    assert [(k, sid) for k, _, sid, _ in conn.t.frames()] == [(RST_STREAM, 1)]
    assert not conn.is_open(1) and not conn.t.closed


def test_a_declared_message_is_granted_its_size_once_and_released_when_consumed(conn):
    conn.data_received(frame(HEADERS, END_HEADERS, 1, conn.enc.encode(REQUEST)))
    conn.data_received(frame(HEADERS, END_HEADERS, 3, conn.enc.encode(REQUEST)))
    conn.t.frames()
    more = LIMITS.max_grant
    assert conn.grant(1, LIMITS.stream_window + more)
    assert not conn.grant(3, LIMITS.stream_window + 1)  # this connection's grant is spent
    assert [(sid, struct.unpack(">I", p)[0]) for _, _, sid, p in conn.t.frames()] == [
        (1, more),
        (0, more),
    ]
    conn.reset(1)  # released with the stream
    assert conn.grant(3, LIMITS.stream_window + 1)


def test_a_repeated_block_of_indexed_fields_is_decoded_once_until_the_table_changes(conn):
    first = conn.enc.encode(REQUEST)
    again = conn.enc.encode(REQUEST)  # all indexed now
    assert not again.translate(None, bytes(range(0x80, 0xFF)))
    conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 1, first))
    conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 3, again))
    conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 5, again))
    assert list(conn._header_lists.cached) == [again]
    # A block that adds to the table may shift what the same indexes mean.
    changed = [*REQUEST[:2], (":path", "/svc/Other"), *REQUEST[3:]]
    conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 7, conn.enc.encode(changed)))
    assert conn._header_lists.cached == {}
    conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 9, conn.enc.encode(changed)))
    paths = [e[2][":path"] for e in conn.handler.events if e[0] == "headers"]
    assert paths == ["/svc/M", "/svc/M", "/svc/M", "/svc/Other", "/svc/Other"]


@pytest.mark.parametrize(
    "value, prefix, encoded",
    [(10, 5, b"\x0a"), (1337, 5, b"\x1f\x9a\x0a"), (42, 8, b"\x2a"), (127, 7, b"\x7f\x00")],
)
def test_hpack_integers_match_rfc_7541_examples(value, prefix, encoded):
    assert http2.encode_int(value, prefix) == encoded
    assert hpack.Decoder().decode(http2.literal("grpc-status", "0")) == [("grpc-status", "0")]


def test_a_block_of_never_indexed_literals_is_decoded_once_and_the_cache_is_bounded(conn):
    """Our lean clients' requests: literals never added to the table repeat
    byte for byte each step, so each is decoded once; a peer's distinct or
    long blocks are decoded but not kept past the cache's bounds."""
    from lighthouse.rpc.h2.frames import literal

    block = b"\x83\x86" + b"".join(literal(k, v) for k, v in REQUEST[2:])
    for sid in (1, 3, 5):
        conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, sid, block))
    assert list(conn._header_lists.cached) == [block]
    long = block + literal("x-long", "v" * 600)
    conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 7, long))
    assert long not in conn._header_lists.cached
    for i in range(40):
        distinct = block + literal("x-n", str(i))
        conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 9 + 2 * i, distinct))
    assert len(conn._header_lists.cached) == 16
    paths = {e[2][":path"] for e in conn.handler.events if e[0] == "headers"}
    assert paths == {"/svc/M"}


def test_answers_sent_while_corked_leave_in_one_write_per_connection(conn):
    for sid in (1, 3, 5):
        conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, sid, conn.enc.encode(REQUEST)))
    conn.t.frames()
    writes = []
    conn.t.write = lambda data: writes.append(bytes(data))
    with corking.corked():
        for sid in (1, 3, 5):
            conn.send(sid, b"H", b"answer", b"T")
        assert writes == []  # nothing before the end of the block
    assert len(writes) == 1
    conn.t.out += writes[0]
    assert [(k, s) for k, _, s, _ in conn.t.frames()] == [
        (kind, sid) for sid in (1, 3, 5) for kind in (HEADERS, DATA, HEADERS)
    ]
    conn.send(1, b"H", b"late", b"T")  # uncorked and ended: nothing, at once
    assert len(writes) == 1


def test_a_cork_in_another_thread_holds_none_of_this_threads_writes(conn):
    # Servers on several loops share the process (a thread each): one
    # loop's issuing turn must not gather, and later send from its thread,
    # what another loop's connection writes meanwhile.
    conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 1, conn.enc.encode(REQUEST)))
    conn.t.frames()
    writes = []
    conn.t.write = lambda data: writes.append(bytes(data))
    inside, release = threading.Event(), threading.Event()

    def other_loop() -> None:
        with corking.corked():
            inside.set()
            release.wait(10)

    other = threading.Thread(target=other_loop)
    other.start()
    try:
        assert inside.wait(10)
        conn.send(1, b"H", b"answer", b"T")
        assert len(writes) == 1  # sent at once, from this thread
    finally:
        release.set()
        other.join(10)
    assert len(writes) == 1
