"""One load process of bench.lighthouse_scale: its share of the simulated
replica groups, over real gRPC (the lean HTTP/2 client), several groups to a
connection.

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
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import sys
import time
from typing import Any

import psutil

from lighthouse.client import HEARTBEAT_PACED_METHOD, QUORUM_METHOD
from lighthouse.rpc.client_connection import ClientConnection
from lighthouse.rpc.lean_client import LeanChannel, LeanStream
from lighthouse.rpc.proto import torchft_pb2 as pb

HEARTBEAT_METHOD = "/torchft.LighthouseService/Heartbeat"
RECEIVED = [0, False]
"""Bytes the lighthouse sent us while counting (instrumentation of the
client connections: the kernel's per-process counters miss send())."""


CALL: contextvars.ContextVar[list[Any]] = contextvars.ContextVar("CALL")
"""The unary call a task's `ask` started (CountingConnection.start fills it)."""


class CountingConnection(ClientConnection):
    """Counts the bytes received, and stamps each unary call with the time
    the read that ended it began: when its answer reached this process, not
    when the task waiting for it ran (at a step's end thousands of answers
    arrive together, and waking their tasks is the load's cost)."""

    def data_received(self, data: bytes) -> None:
        if RECEIVED[1]:
            RECEIVED[0] += len(data)
        now = time.time()
        waiting = [c for c in self.calls.values() if not c.done.done()]
        super().data_received(data)
        for call in waiting:
            if call.done.done():
                call.arrived = now  # type: ignore[attr-defined]

    def start(self, headers: bytes, message: bytes) -> tuple[int, Any]:
        stream_id, call = super().start(headers, message)
        holder = CALL.get(None)
        if holder is not None:
            holder.append(call)
        return stream_id, call


class Group:
    def __init__(self, gid: int, channel: LeanChannel, cfg: dict[str, Any], out: dict) -> None:
        self.gid = gid
        self.channel = channel
        self.cfg = cfg
        self.out = out
        self.incarnation = 0
        self.period_s = cfg["heartbeat_s"]
        self.asked_at = 0.0
        self.stream: LeanStream | None = None
        self.alive = True

    @property
    def rid(self) -> str:
        return f"group{self.gid:05d}:{self.incarnation}"

    def request(self, step: int) -> bytes:
        member = pb.QuorumMember(
            replica_id=self.rid,
            address=f"http://g{self.gid}:1",
            store_address=f"g{self.gid}:2",
            step=step,
            world_size=self.cfg["world_size"],
        )
        request = pb.LighthouseQuorumRequest(requester=member)
        if self.cfg["view"]:
            request.view.init_sync = False
        return request.SerializeToString()

    def on_advice(self, message: bytes) -> None:
        advice = pb.LighthouseHeartbeatAdvice.FromString(message)
        if advice.interval_ms:
            self.period_s = max(self.cfg["heartbeat_s"], advice.interval_ms / 1000)
        if advice.HasField("gone"):
            now = time.time()
            for rid in advice.gone.replica_ids:
                self.out["gone_heard"].setdefault(rid, now)

    async def heartbeats(self) -> None:
        incarnation = self.incarnation
        hb = pb.LighthouseHeartbeatRequest(replica_id=self.rid).SerializeToString()
        if self.cfg["paced"]:
            self.stream = await self.channel.stream(HEARTBEAT_PACED_METHOD, self.on_advice, 60)
        while self.alive and incarnation == self.incarnation:
            since = time.time() - self.asked_at
            if since < self.period_s:
                await asyncio.sleep(self.period_s - since)
                continue
            try:
                if self.stream is not None:
                    self.stream.write(hb)
                else:
                    await self.channel.unary(HEARTBEAT_METHOD, hb, 10)
                self.out["heartbeats"] += RECEIVED[1]
            except Exception as e:  # counted; the group goes on, as ours does
                self.out["errors"].append(f"heartbeat: {e!r}"[:200])
            await asyncio.sleep(self.period_s)

    async def ask(self, step: int, timeout_s: float) -> tuple[float, float, float, int, int]:
        """(sent, arrived, woken, answer bytes, members the answer counts)."""
        holder: list[Any] = []
        CALL.set(holder)
        self.asked_at = sent = time.time()
        answer = await self.channel.unary(QUORUM_METHOD, self.request(step), timeout_s)
        woken = time.time()
        done = getattr(holder[-1], "arrived", None) or woken
        response = pb.LighthouseQuorumResponse.FromString(answer)
        if response.views:
            members = response.views[0].replica_world_size
        else:
            members = len(response.quorum.participants)
        return sent, done, woken, len(answer), members

    def kill(self) -> None:
        self.alive = False
        if self.stream is not None:
            self.stream.cancel()  # RST_STREAM: the lighthouse sees the stream end
            self.stream = None
        self.out["killed"][self.rid] = time.time()

    def restart(self) -> asyncio.Task[None]:
        self.incarnation += 1
        self.alive = True
        return asyncio.create_task(self.heartbeats())


async def run(cfg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "steps": {},
        "answer_bytes": 0,
        "answers": 0,
        "heartbeats": 0,
        "errors": [],
        "killed": {},
        "gone_heard": {},
        "first_without": {},
    }
    per = cfg["groups_per_connection"]
    gids = cfg["gids"]
    channels = [
        LeanChannel(cfg["target"], connection=CountingConnection) for _ in range(0, len(gids), per)
    ]
    groups = [Group(g, channels[i // per], cfg, out) for i, g in enumerate(gids)]
    kills = {int(g): int(step) for g, step in cfg["kills"].items()}
    beats = []
    for group in groups:  # paced: no connection storm
        beats.append(asyncio.create_task(group.heartbeats()))
        await asyncio.sleep(0.0005)

    async def warm(group: Group) -> None:
        # Until a quorum of every group: one issued before the last groups
        # connected (they were not yet healthy) leaves them waiting for a
        # next one, which the answered groups must ask for too.
        while (await group.ask(0, 600))[-1] < cfg["groups"]:
            pass

    await asyncio.gather(*(warm(g) for g in groups))
    print("ready", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    t0, steps, window_from = json.loads(line)
    me = psutil.Process()
    cpu0 = None

    async def one(group: Group, step: int) -> None:
        killed_at = kills.get(group.gid)
        if killed_at is not None and killed_at <= step < killed_at + 2:
            return
        if killed_at is not None and step == killed_at + 2:
            beats.append(group.restart())
        try:
            sent, done, woken, nbytes, members = await group.ask(step, 60)
        except Exception as e:
            out["errors"].append(f"quorum step {step}: {e!r}"[:200])
            return
        rows = out["steps"].setdefault(step, [])
        rows.append((sent, done, woken))
        if step >= window_from:
            out["answer_bytes"] += nbytes
            out["answers"] += 1
        if members < cfg["groups"]:
            out["first_without"].setdefault(step, done)

    for step in range(1, steps + 1):
        at = t0 + (step - 1) * cfg["step_s"]
        if step == window_from:
            cpu0 = me.cpu_times()
            RECEIVED[1] = True
        for group in groups:  # a dying group dies just before its step
            if kills.get(group.gid) == step:
                await asyncio.sleep(max(0.0, at - 0.5 - time.time()))
                group.kill()
        await asyncio.sleep(max(0.0, at - time.time()))
        await asyncio.gather(*(one(g, step) for g in groups))
    cpu1 = me.cpu_times()
    RECEIVED[1] = False
    out["received"] = RECEIVED[0]
    print("stepped", flush=True)  # the window ends; every stream ends on the next line
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    for group in groups:
        group.alive = False
    for task in beats:
        task.cancel()
    for channel in channels:
        channel.close()
    out["cpu_s"] = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system) if cpu0 else 0.0
    return out


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if cfg["nice"]:
        # The groups stand for other machines: on this box they yield the
        # CPU to the lighthouse rather than share it at the step's burst.
        os.nice(19)
    print(json.dumps(asyncio.run(run(cfg))), flush=True)


if __name__ == "__main__":
    main()
