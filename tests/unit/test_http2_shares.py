"""Fair shares of the server's pools between hosts, work charged by what it
costs, and the time limits of a connection (lighthouse.rpc.h2.shares,
server_connection, connections): tables, and connections fed bytes."""

from __future__ import annotations

import asyncio
import dataclasses
import struct

import hpack
import pytest

from lighthouse.rpc.h2 import frames
from lighthouse.rpc.h2.connections import Connections
from lighthouse.rpc.h2.frames import (
    ACK,
    COMPRESSION_ERROR,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    HEADERS,
    PING,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)
from lighthouse.rpc.h2.header_lists import CACHED_BLOCKS, HeaderLists, cached_size, size_updates
from lighthouse.rpc.h2.limits import LIMITS
from lighthouse.rpc.h2.server_connection import Connection
from lighthouse.rpc.h2.shares import HostShares, ProcessBudget, TurnShares, fair_limit
from tests.unit.h2_fakes import REQUEST, FakeTransport, RecordingHandler, connect, goaway_code
from tests.unit.virtual_clock import VirtualClockLoop


def _next_turn(loop: VirtualClockLoop) -> None:
    loop.run_until_complete(asyncio.sleep(0))


# ---- the pools' shares (pure) ----------------------------------------------------------


@pytest.mark.parametrize(
    "cap, others, limit",
    [(100, 0, 50), (100, 1, 33), (100, 2, 25), (100, 98, 1), (3, 5, 1), (16_384, 0, 8192)],
)
def test_a_host_may_hold_its_fair_part_of_a_pool(cap, others, limit):
    assert fair_limit(cap, others) == limit


@pytest.mark.parametrize(
    "held, host, n, taken",
    [
        ({}, "a", 50, True),  # alone: half
        ({}, "a", 51, False),
        ({"a": 40}, "a", 10, True),
        ({"a": 40}, "a", 11, False),
        ({"a": 50}, "b", 33, True),  # beside one other: a third, though a holds more
        ({"a": 50}, "b", 34, False),
        ({"a": 33, "b": 33}, "c", 25, True),
        ({"a": 33, "b": 33}, "a", 1, False),  # a is over its share now that c may come
        ({"a": 10, "b": 10, "c": 10}, "d", 20, True),
        ({"a": 30, "b": 30, "c": 30}, "d", 11, False),  # past the pool itself
    ],
)
def test_a_take_fits_the_pool_and_the_hosts_share(held, host, n, taken):
    pool = HostShares(100)
    for who, amount in held.items():
        pool.add(who, amount)
    assert pool.take(host, n) is taken
    assert pool.total == sum(held.values()) + (n if taken else 0)


def test_a_release_forgets_a_host_that_holds_nothing():
    pool = HostShares(100)
    pool.add("a", 10)
    assert pool.over("a") is False and pool.limit("b") == 33
    pool.release("a", 10)
    assert pool.by_host == {} and pool.total == 0 and pool.limit("b") == 50


def test_a_turn_gives_each_host_its_units_until_the_next_turn():
    soon: list = []
    turn = TurnShares(100, soon.append)
    turn.spend("a", 70)
    turn.spend("a", 40)
    turn.spend("b", 10)
    assert (turn.left("a"), turn.left("b"), turn.left("c")) == (-10, 90, 100)
    assert len(soon) == 1  # one reset asked for, whatever was spent
    soon.pop()()
    assert turn.left("a") == 100 and turn.spent == {}
    turn.spend("a", 0)
    assert soon == []


# ---- work charged by what it costs -----------------------------------------------------


def test_connections_of_one_host_share_its_turn_and_another_host_has_its_own(loop):
    limits = dataclasses.replace(LIMITS, work_per_read=10, work_per_host_turn=15)
    budget = ProcessBudget(limits)
    (a1, t1, _), (a2, t2, _) = (connect(limits, budget, "a") for _ in range(2))
    b, tb, _ = connect(limits, budget, "b")
    _next_turn(loop)
    acks = frame(SETTINGS, ACK, 0, b"") * 12
    for conn in (a1, a2, b):
        conn.data_received(acks)
    assert (len(a1._buf), len(a2._buf), len(b._buf)) == (2 * 9, 7 * 9, 2 * 9)
    assert not t1.reading and not t2.reading  # their rest waits for the next turn
    _next_turn(loop)
    assert (len(a1._buf), len(a2._buf), len(b._buf)) == (0, 0, 0)  # 2 + 7 of a's 15


def test_a_header_block_is_charged_by_its_bytes(loop):
    limits = dataclasses.replace(LIMITS, work_per_read=512)
    conn, t, handler = connect(limits)
    big = hpack.Encoder().encode(REQUEST + [("x-pad", "v" * 4000)], huffman=False)
    assert len(big) > 4000
    conn.data_received(frame(HEADERS, END_HEADERS, 1, big) + frame(SETTINGS, ACK, 0, b""))
    assert handler.opened == [1] and len(conn._buf) == 9  # the ack waits for the next turn


@pytest.mark.parametrize(
    "block, updates",
    [(b"", 0), (b"\x82", 0), (b"\x20\x82", 1), (b"\x3f\xe1\x1f\x20\x82", 2), (b"\x20" * 3, 3),
     (b"\x20" * 16_000, 3)],
)  # fmt: skip
def test_leading_table_size_updates_are_counted(block, updates):
    assert size_updates(block) == updates


def test_a_block_of_more_than_two_table_size_updates_is_a_compression_error(loop):
    conn, t, handler = connect()
    conn.data_received(frame(HEADERS, END_HEADERS, 1, b"\x20" * 3 + b"\x82"))
    assert goaway_code(t) == COMPRESSION_ERROR and handler.opened == []


# ---- per-connection memory, counted ------------------------------------------------------


def test_the_header_cache_is_counted_and_stops_at_the_hosts_share():
    memory = HostShares(4 * 1024)
    lists = HeaderLists(LIMITS.max_header_list, memory, "a")
    blocks = [frames.literal(":path", f"/s/M{i}") + frames.literal(":method", "POST")
              for i in range(CACHED_BLOCKS)]  # fmt: skip
    for block in blocks:
        lists.decode(block)
    assert 0 < len(lists.cached) < CACHED_BLOCKS  # half of 4 KiB: a few blocks
    assert memory.held("a") == lists.cached_bytes <= 2048
    one = blocks[0]
    lists.decode(one)  # cached: no decode, no work
    assert lists.work == 0
    lists.decode(blocks[-1])  # not cached (past the share): decoded, charged by bytes
    assert lists.work >= 1 + len(blocks[-1]) // 4
    assert cached_size(one, lists.cached[one]) <= lists.cached_bytes
    lists.clear()
    assert memory.total == 0 and lists.cached == {}


def test_a_host_past_its_memory_share_has_its_new_streams_refused(loop):
    limits = dataclasses.replace(LIMITS, process_memory=150_000)
    budget = ProcessBudget(limits)
    conn, t, handler = connect(limits, budget)
    enc = hpack.Encoder()
    conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 1, enc.encode(REQUEST)))
    conn.send(1, b"H", bytes(150_000), None)  # waits on the peer's window: counted
    assert budget.memory.held("127.0.0.1") > 80_000 and budget.memory.over("127.0.0.1")
    conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 3, enc.encode(REQUEST)))
    assert (RST_STREAM, 0, 3, struct.pack(">I", REFUSED_STREAM)) in t.frames()
    conn.connection_lost(None)
    assert budget.memory.total == 0


# ---- time limits ----------------------------------------------------------------------


def test_answers_unread_on_the_peers_windows_end_the_connection(loop):
    conn, t, _ = connect()
    conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 1, hpack.Encoder().encode(REQUEST)))
    conn.send(1, b"H", bytes(100_000), b"T")
    since = conn.blocked_since
    assert since is not None
    conn.tick(since + LIMITS.write_stall_s - 1)
    assert not t.closed
    conn.data_received(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 10_000)))
    conn.data_received(frame(WINDOW_UPDATE, 0, 1, struct.pack(">I", 10_000)))
    assert conn.blocked_since is not None and conn.blocked_since > since  # progress
    conn.tick(conn.blocked_since + LIMITS.write_stall_s + 1)
    assert goaway_code(t) == ENHANCE_YOUR_CALM


def test_a_quiet_peer_gets_a_keepalive_ping_and_is_cut_off_without_its_ack(loop):
    conn, t, _ = connect()
    now = loop.time() + 1000.0
    conn.tick(now)  # the reads so far are seen
    conn.tick(now + LIMITS.keepalive_s - 1)
    assert t.frames() == []
    conn.tick(now + LIMITS.keepalive_s)
    assert [(k, f) for k, f, _, _ in t.frames()] == [(PING, 0)]
    conn.data_received(frame(PING, ACK, 0, b"keepaliv"))  # answered: quiet again from here
    conn.tick(now + LIMITS.keepalive_s + 1)
    conn.tick(now + 2 * LIMITS.keepalive_s + 1)
    assert [k for k, *_ in t.frames()] == [PING]
    conn.tick(now + 2 * LIMITS.keepalive_s + 1 + LIMITS.ping_timeout_s)
    assert t.cut


def test_a_close_keeps_its_abort_timer_when_the_peer_takes_nothing(loop):
    handler = RecordingHandler()
    t = FakeTransport(reads=False)
    conn = Connection(handler)
    t.protocol = conn
    conn.connection_made(t)
    conn.close()
    conn.pause_writing()  # the GOAWAY and more sit unsent
    loop.run_until_complete(asyncio.sleep(LIMITS.close_s + 1))
    assert t.cut


def test_an_evicted_connection_drops_its_socket_at_once(loop):
    pool = Connections(cap=2)
    first, t, _ = connect(host="a")
    assert pool.admit(first)
    first.idle_since = 0.0
    second, _, _ = connect(host="a")
    assert pool.admit(second) and t.cut and goaway_code(t) == 0


def test_a_refused_connection_is_aborted_as_it_is_made(loop):
    pool = Connections(cap=1)
    busy, _, _ = connect(host="a")
    assert pool.admit(busy)
    busy.idle_since = None
    t = FakeTransport(host="b")
    conn = Connection(RecordingHandler(), pool)
    conn.connection_made(t)
    assert t.cut and t.out == b"" and conn not in pool.open
    conn.data_received(frames.PREFACE)
    assert t.out == b""
