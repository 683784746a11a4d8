"""What a peer can make one server connection hold or do, bound by bound
(lighthouse.rpc.h2.limits), on a connection fed bytes (no sockets)."""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import zlib

import hpack
import pytest

from lighthouse.rpc.h2 import frames
from lighthouse.rpc.h2.connections import Connections
from lighthouse.rpc.h2.frames import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    HEADERS,
    PING,
    PRIORITY,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)
from lighthouse.rpc.h2.limits import LIMITS, TokenBucket
from lighthouse.rpc.h2.server_connection import Connection
from lighthouse.rpc.h2.shares import ProcessBudget
from lighthouse.rpc.lean.server import MAX_MESSAGE_BYTES, LeanServer, decompressed
from lighthouse.rpc.lean.server_call import echo
from tests.unit.h2_fakes import REQUEST, FakeTransport, connect, goaway_code


def _next_turn() -> None:
    """One turn of the loop: the work budgets' new turn, and the reads they left."""
    asyncio.get_event_loop().run_until_complete(asyncio.sleep(0))


def test_a_header_block_over_the_limit_is_refused_before_it_is_decoded(loop):
    conn, t, handler = connect()
    conn.data_received(frame(HEADERS, 0, 1, b"\x00" * 9000))
    conn.data_received(frame(CONTINUATION, 0, 1, b"\x00" * 9000))
    assert goaway_code(t) == ENHANCE_YOUR_CALM and t.closed and handler.opened == []


def test_empty_continuations_without_end_are_cut_off_by_count(loop):
    conn, t, _ = connect()
    conn.data_received(frame(HEADERS, 0, 1, b""))
    conn.data_received(frame(CONTINUATION, 0, 1, b"") * (LIMITS.max_continuations + 1))
    assert goaway_code(t) == ENHANCE_YOUR_CALM


def test_one_huge_literal_never_reaches_the_decoder(loop):
    conn, t, _ = connect()
    huge = hpack.Encoder().encode([("x-big", "v" * 1_000_000)], huffman=False)
    conn.data_received(frame(HEADERS, 0, 1, huge[:16_000]))
    conn.data_received(frame(CONTINUATION, 0, 1, huge[16_000:32_000]))
    assert goaway_code(t) == ENHANCE_YOUR_CALM


def test_a_decoded_header_list_over_the_limit_closes_the_connection(loop):
    conn, t, handler = connect()
    # Few bytes on the wire, many once decoded: one entry indexed over and over.
    enc = hpack.Encoder()
    first = enc.encode([("x-a", "v" * 3000)])
    again = enc.encode([("x-a", "v" * 3000)]) * 10
    conn.data_received(frame(HEADERS, END_HEADERS, 1, first + again))
    assert goaway_code(t) == ENHANCE_YOUR_CALM and handler.opened == []


def test_pings_faster_than_the_policy_without_answers_between_get_enhance_your_calm(loop):
    conn, t, _ = connect()
    conn.data_received(frame(PING, 0, 0, b"12345678") * LIMITS.ping_strikes)
    assert [k for k, *_ in t.frames()] == [PING] * LIMITS.ping_strikes
    conn.data_received(frame(PING, 0, 0, b"12345678") * 2)
    assert goaway_code(t) == ENHANCE_YOUR_CALM


def test_an_answer_between_pings_clears_the_strikes(loop):
    conn, t, _ = connect()
    enc = hpack.Encoder()
    for sid in range(1, 2 * (LIMITS.ping_strikes + 2), 2):
        conn.data_received(frame(PING, 0, 0, b"12345678"))
        conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, sid, enc.encode(REQUEST)))
        conn.send(sid, b"H", b"", b"T")
    assert not t.closed


def test_a_settings_flood_is_cut_off_at_the_rate(loop):
    conn, t, _ = connect()
    burst = int(LIMITS.settings_rate[0])
    conn.data_received(frame(SETTINGS, 0, 0, b"") * (burst - 1))  # one was taken at setup
    assert not t.closed
    conn.data_received(frame(SETTINGS, 0, 0, b"") * 2)
    assert goaway_code(t) == ENHANCE_YOUR_CALM


def test_rapid_reset_is_cut_off_at_the_rate(loop):
    conn, t, handler = connect()
    block = hpack.Encoder().encode(REQUEST)
    flood = b"".join(
        frame(HEADERS, END_HEADERS, sid, block)
        + frame(RST_STREAM, 0, sid, struct.pack(">I", frames.CANCEL))
        for sid in range(1, 2 * 1000, 2)
    )
    for pos in range(0, len(flood), 65536):  # as reads, each run in its own turn
        conn.data_received(flood[pos : pos + 65536])
        while conn._backlog and not t.closed:
            _next_turn()
    assert goaway_code(t) == ENHANCE_YOUR_CALM
    assert len(handler.opened) <= LIMITS.reset_rate[0] + 5


def test_one_read_is_processed_within_the_work_budget_the_rest_next_turn(loop):
    conn, t, handler = connect()
    enc = hpack.Encoder()
    many = b"".join(
        frame(HEADERS, END_HEADERS | END_STREAM, sid, enc.encode(REQUEST))
        for sid in range(1, 2 * 90, 2)
    )
    conn.data_received(many)
    first_turn = len(handler.opened)
    assert 0 < first_turn < 90 and not t.reading
    loop.run_until_complete(asyncio.sleep(0))
    assert len(handler.opened) == 90 and t.reading


def test_a_peer_that_takes_no_answers_is_not_read_then_cut_off(loop):
    conn, t, _ = connect(dataclasses.replace(LIMITS, write_stall_s=0.01))
    conn.pause_writing()  # the transport's buffer passed its high mark
    assert not t.reading
    conn.data_received(frame(PING, 0, 0, b"12345678") * 3)  # (a TLS layer may still deliver)
    assert t.frames() == []  # not processed while the peer reads nothing
    conn.resume_writing()
    assert [k for k, *_ in t.frames()] == [PING] * 3 and t.reading
    conn.pause_writing()
    loop.run_until_complete(asyncio.sleep(0.05))  # past write_stall_s, on the virtual clock
    assert goaway_code(t) == ENHANCE_YOUR_CALM and t.closed


def test_answers_blocked_by_the_peers_window_refuse_new_streams_past_the_mark(loop):
    conn, t, handler = connect()
    conn.data_received(frame(SETTINGS, 0, 0, struct.pack(">HI", 0x4, 0)))  # zero windows
    enc = hpack.Encoder()
    answer = bytes(LIMITS.write_high // 2 + 1)
    for sid in (1, 3, 5):
        conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, sid, enc.encode(REQUEST)))
        conn.send(sid, b"H", answer, b"T")
    out = t.frames()
    assert handler.opened == [1, 3]
    assert (RST_STREAM, 0, 5, struct.pack(">I", REFUSED_STREAM)) in out


def test_the_process_budget_resets_the_stream_that_would_pass_its_hosts_share(loop):
    budget = ProcessBudget(dataclasses.replace(LIMITS, process_held=60_000))
    first, t1, _ = connect(budget=budget)
    second, t2, h2 = connect(budget=budget)
    other, t3, h3 = connect(budget=budget, host="10.0.0.9")
    block = hpack.Encoder().encode(REQUEST)
    one_call = frame(HEADERS, END_HEADERS, 1, block) + frame(DATA, 0, 1, bytes(16_000))
    first.data_received(one_call)
    second.data_received(one_call)  # past one host's share alone, half of 60,000
    assert [(k, sid) for k, _, sid, _ in t2.frames()] == [(RST_STREAM, 1)]
    assert h2.closed == [1] and budget.held.total == 16_000
    other.data_received(one_call)  # another host: its own share, a third
    assert h3.closed == [] and budget.held.total == 32_000
    first.connection_lost(None)
    other.connection_lost(None)
    assert budget.held.total == 0 and budget.held.by_host == {}


def test_a_host_at_its_share_of_connections_makes_room_from_its_own_idle_ones(loop):
    pool = Connections(cap=6)
    conns = [connect(host=host)[0] for host in ("a", "a", "b", "b")]
    assert all(pool.admit(conn) for conn in conns)
    conns[1].idle_since = None  # a stream open: never the one dropped
    conns[0].idle_since, conns[2].idle_since, conns[3].idle_since = 1.0, 0.5, 2.0
    newer = connect(host="a")[0]  # a holds 2 of 6 beside b: its share of 6 // 3
    assert pool.admit(newer) and conns[0] not in pool.open and conns[2] in pool.open
    newer.idle_since = None
    assert not pool.admit(connect(host="a")[0])  # none of its own idle: refused
    assert pool.hosts.by_host == {"a": 2, "b": 2}


def test_at_the_cap_the_largest_host_gives_up_its_longest_idle_connection(loop):
    pool = Connections(cap=4)
    conns = [connect(host=host)[0] for host in ("a", "a", "b", "c")]
    assert all(pool.admit(conn) for conn in conns)
    conns[1].idle_since = None
    conns[0].idle_since, conns[2].idle_since, conns[3].idle_since = 3.0, 1.0, 2.0
    newer = connect(host="d")[0]
    assert pool.admit(newer) and conns[0] not in pool.open  # a's, though b's is older
    for conn in pool.open:
        conn.idle_since = None
    refused = connect(host="e")[0]
    assert not pool.admit(refused) and len(pool.open) == 4


def test_the_sweep_closes_connections_idle_past_the_timeout(loop):
    pool = Connections(dataclasses.replace(LIMITS, idle_s=10.0))
    idle, t_idle, _ = connect()
    busy, t_busy, _ = connect()
    for conn in (idle, busy):
        pool.admit(conn)
    idle.idle_since, busy.idle_since = 100.0, None
    assert pool.sweep(now=105.0) == 0
    assert pool.sweep(now=111.0) == 1 and t_idle.closed and not t_busy.closed


def test_a_gzip_bomb_decompresses_no_further_than_the_message_limit():
    bomb = zlib.compress(bytes(64 * MAX_MESSAGE_BYTES), 9)
    assert len(bomb) < MAX_MESSAGE_BYTES // 8
    out, code, why = decompressed(bomb, "deflate")
    assert out == b"" and code.name == "RESOURCE_EXHAUSTED" and "larger than max" in why
    fine = zlib.compress(b"hello")
    assert decompressed(fine, "deflate")[0] == b"hello"
    assert decompressed(fine[:-3], "deflate")[1].name == "INTERNAL"


def test_an_answer_echoes_no_more_than_a_bounded_part_of_the_request():
    assert echo("/svc/M") == "/svc/M"
    long = "/" + "x" * 100_000
    assert len(echo(long)) < LIMITS.max_echo + 40


def test_a_token_bucket_allows_its_burst_then_its_rate():
    bucket = TokenBucket((3.0, 0.0))
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]


def _feed(conn: Connection, t: FakeTransport, data: bytes) -> None:
    """`data` as one read, and the turns its work budget leaves for later."""
    conn.data_received(data)
    while conn._backlog and not t.closed:
        _next_turn()


_BLOCK = hpack.Encoder().encode(REQUEST)
_UNKNOWN = hpack.Encoder().encode([(n, "/svc/Nope" if n == ":path" else v) for n, v in REQUEST])


def _answered(conn: Connection, t: FakeTransport) -> None:
    """Stream 1 opened, then answered and closed."""
    _feed(conn, t, frame(HEADERS, END_HEADERS | END_STREAM, 1, _BLOCK))
    conn.send(1, b"H", b"", b"T")


def _open(conn: Connection, t: FakeTransport) -> None:
    _feed(conn, t, frame(HEADERS, END_HEADERS, 1, _BLOCK))


def _calls(count: int, block: bytes = _BLOCK) -> bytes:
    """HEADERS of `count` new calls, streams 1, 3, ..."""
    return b"".join(
        frame(HEADERS, END_HEADERS | END_STREAM, sid, block) for sid in range(1, 2 * count, 2)
    )


def _unknown_calls(count: int) -> bytes:
    return _calls(count, _UNKNOWN)


_U32_ONE = struct.pack(">I", 1)
NO_WORK_FLOODS = {
    # kind: (setup, the flood of `count` frames, its rate)
    "priority": (None, lambda n: frame(PRIORITY, 0, 1, bytes(5)) * n, LIMITS.priority_rate),
    "window_update": (
        None,
        lambda n: frame(WINDOW_UPDATE, 0, 0, _U32_ONE) * n,
        LIMITS.idle_window_update_rate,
    ),
    "empty_data": (_open, lambda n: frame(DATA, 0, 1, b"") * n, LIMITS.empty_data_rate),
    "closed_stream": (
        _answered,
        lambda n: (
            (frame(RST_STREAM, 0, 1, _U32_ONE) + frame(WINDOW_UPDATE, 0, 1, _U32_ONE)) * (n // 2)
        ),
        LIMITS.closed_stream_rate,
    ),
    "answered_headers": (
        _answered,
        lambda n: frame(HEADERS, END_HEADERS | END_STREAM, 1, _BLOCK) * n,
        LIMITS.answered_headers_rate,
    ),
    "refused_call": (None, _unknown_calls, LIMITS.refused_call_rate),
}


@pytest.mark.parametrize("kind", list(NO_WORK_FLOODS))
def test_frames_that_do_no_work_pass_below_their_rate_and_are_calmed_past_it(loop, kind):
    setup, flood, (burst, _) = NO_WORK_FLOODS[kind]
    for count, over in ((int(burst) - 2, False), (int(burst) * 2, True)):
        budget = ProcessBudget()
        handler, t = LeanServer(), FakeTransport()
        conn = Connection(handler, limits=LIMITS, budget=budget)
        conn.connection_made(t)
        conn.data_received(frames.PREFACE + frame(SETTINGS, 0, 0, b""))
        if setup is not None:
            setup(conn, t)
        t.frames()
        _feed(conn, t, flood(count))
        if over:
            assert goaway_code(t) == ENHANCE_YOUR_CALM and t.closed
            assert conn.calmed == kind and budget.calmed == {kind: 1}
        else:
            assert goaway_code(t) is None and not t.closed and budget.calmed == {}


def test_window_updates_for_data_sent_are_not_counted_against_the_rate(loop):
    conn, t, _ = connect()
    _feed(conn, t, frame(HEADERS, END_HEADERS | END_STREAM, 1, _BLOCK))
    conn.send(1, b"H", bytes(1000), b"T")  # one DATA frame: earns its window updates
    updates = int(LIMITS.idle_window_update_rate[0]) + LIMITS.window_updates_per_data - 2
    _feed(conn, t, frame(WINDOW_UPDATE, 0, 0, _U32_ONE) * updates)
    assert not t.closed
    _feed(conn, t, frame(WINDOW_UPDATE, 0, 0, _U32_ONE) * 4)
    assert goaway_code(t) == ENHANCE_YOUR_CALM and conn.calmed == "window_update"


def test_refused_calls_do_not_clear_ping_strikes(loop):
    handler, t = LeanServer(), FakeTransport()
    conn = Connection(handler)
    conn.connection_made(t)
    conn.data_received(frames.PREFACE + frame(SETTINGS, 0, 0, b""))
    for sid in range(1, 2 * (LIMITS.ping_strikes + 2), 2):
        conn.data_received(frame(PING, 0, 0, b"12345678"))
        conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, sid, _UNKNOWN))
    assert goaway_code(t) == ENHANCE_YOUR_CALM and conn.calmed == "ping"


def test_a_window_update_frames_only_what_it_unblocks(loop):
    """100 answers parked on zero stream windows: a connection WINDOW_UPDATE
    visits none of them, a stream's frames only its newly allowed bytes."""
    conn, t, _ = connect()
    _feed(conn, t, frame(SETTINGS, 0, 0, struct.pack(">HI", 0x4, 0)))  # zero windows
    _feed(conn, t, _calls(100))
    for sid in range(1, 200, 2):
        conn.send(sid, b"H", bytes(100_000), b"T")
    t.frames()
    framed = []
    data_frames = conn._data_frames

    def counted(stream_id, out, data, chunks):
        sent = data_frames(stream_id, out, data, chunks)
        framed.append((stream_id, sent))
        return sent

    conn._data_frames = counted  # type: ignore[method-assign]
    _feed(conn, t, frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 20)))
    assert framed == [] and t.frames() == []
    _feed(conn, t, frame(WINDOW_UPDATE, 0, 7, struct.pack(">I", 10)))
    assert framed == [(7, 10)]
    assert [(k, sid, len(p)) for k, _, sid, p in t.frames()] == [(DATA, 7, 10)]
    assert conn._unsent == 100 * 100_000 - 10


def test_a_settings_frame_is_charged_by_its_entries_and_the_streams_walked_once(loop):
    conn, t, _ = connect()
    _feed(conn, t, _calls(50))  # 50 open streams
    entries = [struct.pack(">HI", 0x4, 1000 + i) for i in range(2000)]
    conn.data_received(frame(SETTINGS, 0, 0, b"".join(entries)) + frame(PING, 0, 0, bytes(8)))
    assert conn._work == LIMITS.work_per_read - 1 - 2000 - 50
    assert conn._backlog and [k for k, *_ in t.frames()] == [SETTINGS]  # the PING waits
    assert {s.window for s in conn._streams.values()} == {1000 + 1999}
    _next_turn()
    assert [k for k, *_ in t.frames()] == [PING]
