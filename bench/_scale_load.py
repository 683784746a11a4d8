"""One load process of bench.lighthouse_scale: its share of the simulated
replica groups, over real gRPC (the lean HTTP/2 client's connections),
several groups to a connection.

A group does what a torchft_like ManagerServer does to the lighthouse: one
Quorum call per step at the step's boundary (asking for its view when
`view`), and heartbeats on a HeartbeatPaced stream at the advised period
(`paced`) or unary Heartbeat calls (pytorch/torchft's lighthouse has no
streams), skipped within a period of its last Quorum call, which counts as
one. A group in `kills` dies just before its step: its stream is reset (the
lighthouse sees the stream end, as when a process dies) and it goes silent;
two steps later it comes back under a new replica id, as a restarted group
does. After the last step it says "stepped" and, on the next line from its
parent, closes every connection at once. Stats go to stdout as one JSON line.

A failed call is counted, never the end of the run (bench.lighthouse_scale
--attack counts what an attacking host costs the healthy ones): by call
(quorum, heartbeat: a heartbeat that could not go, or its stream ended by
the server, which is then opened again at the next beat) and by kind
(`failure_kind`: refused, reset or failed), with the first 1,000 as text.
Answers that leave groups out are counted per step (`short`).

Optional: `job` names the lighthouse job the calls are in (the torchft-job
metadata; none: the default job), and `source` the local address the
connections bind, so a load can stand for another host (the server shares
some budgets between hosts).

The groups stand for other machines, so this process spends as little as
it can at a step's burst, where it shares the CPU with the lighthouse: the
calls go out from one loop over the groups, the answers are stamped as
their reads begin and counted without a task each, and they are decoded
after the step's last one is in. One scheduler sends every group's
heartbeats.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import os
import sys
import time
from typing import Any

import psutil

from lighthouse.client import HEARTBEAT_PACED_METHOD, QUORUM_METHOD
from lighthouse.rpc.auth import metadata
from lighthouse.rpc.h2.frames import literal
from lighthouse.rpc.lean.client import grpc_timeout, request_headers
from lighthouse.rpc.lean.client_calls import CallFailed, GrpcConnection, Unavailable
from lighthouse.rpc.proto import torchft_pb2 as pb

HEARTBEAT_METHOD = "/torchft.LighthouseService/Heartbeat"
QUORUM_TIMEOUT_S = 60.0
REFUSING_CODES = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")
REFUSING_RESETS = ("HTTP/2 error 7)", "HTTP/2 error 11)")  # REFUSED_STREAM, ENHANCE_YOUR_CALM
ENDED = ("reset the call", "connection lost", "going away", "no open connection", "is closed")


def failure_kind(error: object) -> str:
    """refused: the server would not take the call (a refusing gRPC status,
    REFUSED_STREAM or ENHANCE_YOUR_CALM); reset: it ended the call or its
    connection (or the call found them ended); failed: anything else (no
    answer in time, a server that does not read, another status)."""
    if isinstance(error, CallFailed):
        return "refused" if error.code.name in REFUSING_CODES else "failed"
    if isinstance(error, Unavailable):
        text = str(error)
        if any(code in text for code in REFUSING_RESETS):
            return "refused"
        if any(word in text for word in ENDED):
            return "reset"
    return "failed"


class Asked:
    """One Quorum call in flight: when it was sent and when its answer's read began."""

    __slots__ = ("group", "sent", "arrived", "call")

    def __init__(self, group: Group, sent: float, call: Any) -> None:
        self.group, self.sent, self.arrived, self.call = group, sent, 0.0, call


class Load:
    """The process's groups, their connections and what they measured."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        host, _, port = cfg["target"].rpartition(":")
        self.host, self.port = host, int(port)
        static = literal(":authority", cfg["target"])
        static += b"".join(literal(k, v) for k, v in metadata(None, cfg.get("job")))
        deadline = literal("grpc-timeout", grpc_timeout(QUORUM_TIMEOUT_S))
        self.quorum_headers = request_headers(QUORUM_METHOD, static) + deadline
        self.heartbeat_headers = request_headers(HEARTBEAT_METHOD, static) + deadline
        self.paced_headers = request_headers(HEARTBEAT_PACED_METHOD, static)
        self.counting = False
        self.received = 0
        """Bytes the lighthouse sent while counting (the kernel's per-process
        counters miss send())."""
        self.outstanding = 0
        self.all_in: asyncio.Future[None] | None = None
        self.closing = False
        """Every connection closes now: the streams' ends are no failures."""
        self.out: dict[str, Any] = {
            "steps": {},
            "answer_bytes": 0,
            "answers": 0,
            "heartbeats": 0,
            "errors": [],
            "failures": {
                call: dict.fromkeys(("refused", "reset", "failed"), 0)
                for call in ("quorum", "heartbeat")
            },
            "short": {},
            "killed": {},
            "gone_heard": {},
            "first_without": {},
        }

    def error(self, call: str, what: str, error: object) -> None:
        self.out["failures"][call][failure_kind(error)] += 1
        if len(self.out["errors"]) < 1000:  # a failing heartbeat fails again each period
            self.out["errors"].append(f"{what}: {error!r}"[:200])

    def answered(self, asked: Asked, now: float) -> None:
        asked.arrived = now
        self.outstanding -= 1
        if self.outstanding == 0 and self.all_in is not None and not self.all_in.done():
            self.all_in.set_result(None)


class LoadConnection(GrpcConnection):
    """A client connection that counts the bytes received and stamps each
    Quorum answer with the time the read that ended it began."""

    def __init__(self, load: Load) -> None:
        super().__init__()
        self.load = load
        self.asked: dict[int, Asked] = {}
        """stream id -> the Quorum call on it still waiting."""

    def data_received(self, data: bytes) -> None:
        now = time.time()
        load = self.load
        if load.counting:
            load.received += len(data)
        super().data_received(data)
        if self.asked:
            for stream_id, asked in list(self.asked.items()):
                if asked.call.done.done():
                    del self.asked[stream_id]
                    load.answered(asked, now)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        asked, self.asked = self.asked, {}
        for one in asked.values():
            self.load.answered(one, time.time())


class Group:
    def __init__(self, gid: int, conn: LoadConnection, load: Load) -> None:
        self.gid = gid
        self.conn = conn
        self.load = load
        self.incarnation = 0
        self.period_s = load.cfg["heartbeat_s"]
        self.asked_at = 0.0
        self.stream: tuple[int, Any] | None = None
        self.alive = True
        self.beat = b""

    @property
    def rid(self) -> str:
        return f"group{self.gid:05d}:{self.incarnation}"

    def request(self, step: int) -> bytes:
        cfg = self.load.cfg
        member = pb.QuorumMember(
            replica_id=self.rid,
            address=f"http://g{self.gid}:1",
            store_address=f"g{self.gid}:2",
            step=step,
            world_size=cfg["world_size"],
        )
        request = pb.LighthouseQuorumRequest(requester=member)
        if cfg["view"]:
            request.view.init_sync = False
        return request.SerializeToString()

    def start(self) -> None:
        """Begins (again) to heartbeat, as the current incarnation."""
        self.alive = True
        self.beat = pb.LighthouseHeartbeatRequest(replica_id=self.rid).SerializeToString()
        if self.load.cfg["paced"]:
            self.open()

    def open(self) -> None:
        self.stream = stream = self.conn.open_stream(self.load.paced_headers, self.on_advice)

        def ended(done: asyncio.Future[bytes]) -> None:
            error = None if done.cancelled() else done.exception()
            if self.stream is stream and not self.load.closing:  # not a kill, not the end
                self.stream = None  # opened again at the next beat
                self.load.error("heartbeat", "the heartbeat stream ended", error or "ended")

        stream[1].done.add_done_callback(ended)

    def on_advice(self, message: bytes) -> None:
        advice = pb.LighthouseHeartbeatAdvice.FromString(message)
        if advice.interval_ms:
            self.period_s = max(self.load.cfg["heartbeat_s"], advice.interval_ms / 1000)
        if advice.HasField("gone"):
            now = time.time()
            for rid in advice.gone.replica_ids:
                self.load.out["gone_heard"].setdefault(rid, now)

    def heartbeat(self) -> None:
        if self.load.cfg["paced"]:
            if self.stream is None:
                self.open()
            assert self.stream is not None
            self.conn.send_message(*self.stream, self.beat)
        else:  # unary, its answer unread
            self.conn.start(self.load.heartbeat_headers, self.beat)[1].done.add_done_callback(
                _quiet
            )

    def ask(self, step: int) -> Asked:
        self.asked_at = sent = time.time()
        stream_id, call = self.conn.start(self.load.quorum_headers, self.request(step))
        asked = self.conn.asked[stream_id] = Asked(self, sent, call)
        self.load.outstanding += 1
        return asked

    def kill(self) -> None:
        self.alive = False
        if self.stream is not None:
            self.conn.cancel(self.stream[0])  # RST_STREAM: the lighthouse sees the stream end
            self.stream = None
        self.load.out["killed"][self.rid] = time.time()


def _quiet(future: asyncio.Future[Any]) -> None:
    """Retrieves a call's end that nobody reads (a heartbeat's, a stream's at close)."""
    if not future.cancelled():
        future.exception()


async def heartbeats(groups: list[Group], load: Load) -> None:
    """Every group's heartbeats from one task: each at its period, none
    within a period of its last Quorum call."""
    due = [(time.time() + i * 0.0005, i) for i in range(len(groups))]  # no storm at start
    heapq.heapify(due)
    while True:
        now = time.time()
        while due and due[0][0] <= now:
            _, i = heapq.heappop(due)
            group = groups[i]
            wait_s = group.period_s - (now - group.asked_at)
            if not group.alive or wait_s < 0.001:  # (less can vanish in `now + wait_s`)
                wait_s = group.period_s
                try:
                    if group.alive:
                        group.heartbeat()
                        load.out["heartbeats"] += load.counting
                except Exception as e:  # counted; the group goes on, as ours does
                    load.error("heartbeat", "heartbeat", e)
            heapq.heappush(due, (now + wait_s, i))
        await asyncio.sleep(min(0.05, max(0.0, due[0][0] - time.time())) if due else 0.05)


def record(load: Load, step: int, asked: list[Asked], window_from: int) -> None:
    """A step's answers, decoded once they are all in."""
    rows = load.out["steps"].setdefault(step, [])
    for one in asked:
        call = one.call
        if not call.done.done() or call.done.exception() is not None:
            error = call.done.exception() if call.done.done() else "no answer"
            load.error("quorum", f"quorum step {step}", error)
            continue
        answer = call.done.result()
        response = pb.LighthouseQuorumResponse.FromString(answer)
        members = (
            response.views[0].replica_world_size
            if response.views
            else len(response.quorum.participants)
        )
        rows.append((one.sent, one.arrived))
        if step >= window_from:
            load.out["answer_bytes"] += len(answer)
            load.out["answers"] += 1
        if members < load.cfg["groups"]:
            load.out["first_without"].setdefault(step, one.arrived)
            load.out["short"][step] = load.out["short"].get(step, 0) + 1


async def ask_all(load: Load, groups: list[Group], step: int) -> list[Asked]:
    """One Quorum call of each group, and the wait for every answer."""
    loop = asyncio.get_running_loop()
    load.all_in = loop.create_future()
    asked = []
    for group in groups:
        try:
            asked.append(group.ask(step))
        except Exception as e:
            load.error("quorum", f"quorum step {step}", e)
    if load.outstanding:
        try:
            await asyncio.wait_for(asyncio.shield(load.all_in), QUORUM_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass  # the missing answers are errors (record)
    for conn in {group.conn for group in groups}:
        conn.asked.clear()
    load.outstanding = 0
    return asked


async def run(cfg: dict[str, Any]) -> dict[str, Any]:
    load = Load(cfg)
    loop = asyncio.get_running_loop()
    per = cfg["groups_per_connection"]
    gids = cfg["gids"]
    conns = []
    source = (cfg["source"], 0) if cfg.get("source") else None
    for _ in range(0, len(gids), per):
        _, conn = await loop.create_connection(
            lambda: LoadConnection(load), load.host, load.port, local_addr=source
        )
        conns.append(conn)
    groups = [Group(g, conns[i // per], load) for i, g in enumerate(gids)]
    for group in groups:
        group.start()
    beats = loop.create_task(heartbeats(groups, load))
    kills = {int(g): int(step) for g, step in cfg["kills"].items()}

    async def warm(group: Group) -> None:
        # Until a quorum of every group: one issued before the last groups
        # connected (they were not yet healthy) leaves them waiting for a
        # next one, which the answered groups must ask for too.
        while True:
            _, call = group.conn.start(load.quorum_headers, group.request(0))
            call.done.add_done_callback(_quiet)  # the first failure ends the load
            answer = await asyncio.wait_for(call.done, 600)
            response = pb.LighthouseQuorumResponse.FromString(answer)
            members = response.views[0].replica_world_size if response.views else 0
            if max(members, len(response.quorum.participants)) >= cfg["groups"]:
                return

    await asyncio.gather(*(warm(g) for g in groups))
    print("ready", flush=True)
    line = await loop.run_in_executor(None, sys.stdin.readline)
    t0, steps, window_from = json.loads(line)
    me = psutil.Process()
    cpu0 = None
    for step in range(1, steps + 1):
        at = t0 + (step - 1) * cfg["step_s"]
        if step == window_from:
            cpu0 = me.cpu_times()
            load.counting = True
        asking = []
        for group in groups:  # a dying group dies just before its step
            killed_at = kills.get(group.gid)
            if killed_at == step:
                await asyncio.sleep(max(0.0, at - 0.5 - time.time()))
                group.kill()
            if killed_at is not None and step == killed_at + 2:
                group.incarnation += 1
                group.start()
            if killed_at is None or not killed_at <= step < killed_at + 2:
                asking.append(group)
        await asyncio.sleep(max(0.0, at - time.time()))
        record(load, step, await ask_all(load, asking, step), window_from)
    cpu1 = me.cpu_times()
    load.counting = False
    load.out["received"] = load.received
    print("stepped", flush=True)  # the window ends; every stream ends on the next line
    await loop.run_in_executor(None, sys.stdin.readline)
    beats.cancel()
    load.closing = True
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()
    load.out["cpu_s"] = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system) if cpu0 else 0.0
    return load.out


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if cfg["nice"]:
        # The groups stand for other machines: on this box they yield the
        # CPU to the lighthouse rather than share it at the step's burst.
        os.nice(19)
    print(json.dumps(asyncio.run(run(cfg))), flush=True)


if __name__ == "__main__":
    main()
