"""CPU a step's control path costs a one-rank replica group, by thread, beside its floor.

    python -m bench.quorum_cpu [--steps 400] [--repeats 5] [--pace-ms 5] [--out DIR] [--smoke]

Why: on a machine whose cores the training ranks keep busy, every
microsecond of CPU our threads spend per step is a microsecond of step time
(bench/NOTES.md, "Fourth pass"). This measures that CPU without training:
one process holds a torchft_like Manager (world size 1, gloo, our lighthouse
in a child process, min_replicas 1) and a bare asyncio loop in a thread, and
takes turns between them.

Contenders, in blocks of --steps, the order alternating per repeat:
- manager: start_quorum, a pause (the forward pass), one allreduce of a
  1,000-float tensor, should_commit; the CPU of the ManagerServer's loop
  thread and of the training thread, per step.
- floor: the least any asyncio design of the step's quorum costs that loop:
  the training thread hands a coroutine to the loop
  (run_coroutine_threadsafe), which writes 300 bytes to a child process that
  echoes them, and returns once they are back: two wake-ups of the loop, one
  write, one read; with the same pause.

Figures: per contender, the median over repeats of the loop's and the
training thread's CPU per step (schedstat, microseconds), min and max; that
of the process the loop talks to (`peer_us`: the lighthouse, the echo
child), all its threads; and
its loop's CPU per second over --idle-s seconds without steps (the
manager's: its heartbeats, every 100 ms by default).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
from torch.distributed import TCPStore

from bench._report import add_common_args, report, results_file
from tools.procs import free_port, kill_tree, wait_listening


def thread_cpu_ns(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[0])


def start_lighthouse() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lighthouse", "--bind", f"127.0.0.1:{port}",
         "--min-replicas", "1", "--join-timeout-ms", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_listening(port, proc, "lighthouse")
    except BaseException:
        kill_tree(proc.pid)
        raise
    return proc, f"http://127.0.0.1:{port}"


class Floor:
    """A loop thread, a connection to an echoing child, one round trip a step."""

    def __init__(self, pace_s: float) -> None:
        self.pace_s = pace_s
        server = socket.create_server(("127.0.0.1", 0))
        echo = "import socket,sys\nc=socket.create_connection(('127.0.0.1',int(sys.argv[1])))\n"
        echo += "while (d:=c.recv(4096)): c.sendall(d)"
        self.child = subprocess.Popen([sys.executable, "-c", echo, str(server.getsockname()[1])])
        server.settimeout(30)
        conn, _ = server.accept()
        server.close()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="floor", daemon=True)
        self.thread.start()
        self.reader, self.writer = asyncio.run_coroutine_threadsafe(
            asyncio.open_connection(sock=conn), self.loop
        ).result(10)

    async def _round_trip(self) -> None:
        self.writer.write(b"x" * 300)
        await self.reader.readexactly(300)

    def step(self) -> None:
        done = asyncio.run_coroutine_threadsafe(self._round_trip(), self.loop)
        time.sleep(self.pace_s)  # as the group's step: the loop sleeps as long between steps
        done.result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.writer.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        kill_tree(self.child.pid)


class OneRankGroup:
    def __init__(self, lighthouse: str, pace_s: float) -> None:
        from torchft_like.manager import Manager
        from torchft_like.process_group import ProcessGroupGloo

        t = timedelta(seconds=30)
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=t), min_replica_size=1, rank=0, world_size=1,
            store_addr="127.0.0.1", store_port=self.store.port, lighthouse_addr=lighthouse,
            replica_id="quorum_cpu", hostname="127.0.0.1", timeout=t, connect_timeout=t,
        )  # fmt: skip
        self.manager.set_state_dict_fns(lambda _: None, lambda: {})
        self.tensor = torch.ones(1000)
        self.pace_s = pace_s

    def step(self) -> None:
        self.manager.start_quorum()
        time.sleep(self.pace_s)
        self.manager.allreduce(self.tensor).wait()
        self.manager.should_commit()

    def close(self) -> None:
        self.manager.shutdown()


def loop_thread_id(name_prefix: str) -> int:
    for t in threading.enumerate():
        if t.name.startswith(name_prefix) and t.native_id is not None:
            return t.native_id
    raise RuntimeError(f"no thread named {name_prefix}*")


def process_cpu_ns(pid: int) -> int:
    """CPU nanoseconds so far of every thread of process `pid` (those that ended not counted)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # the thread ended meanwhile
            pass
    return total


def block(
    step: Callable[[], None], loop_id: int, peer_pid: int, steps: int
) -> tuple[float, float, float]:
    """CPU per step, in microseconds, over `steps`: the loop thread, the
    training thread, and the process the loop talks to."""
    me = threading.get_native_id()
    loop0, me0, peer0 = thread_cpu_ns(loop_id), thread_cpu_ns(me), process_cpu_ns(peer_pid)
    for _ in range(steps):
        step()
    n = steps * 1e3
    return (
        (thread_cpu_ns(loop_id) - loop0) / n,
        (thread_cpu_ns(me) - me0) / n,
        (process_cpu_ns(peer_pid) - peer0) / n,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=400, help="steps per block")
    parser.add_argument("--repeats", type=int, default=5, help="blocks per contender")
    parser.add_argument("--pace-ms", type=float, default=5.0, help="the pause in each step")
    parser.add_argument("--idle-s", type=float, default=5.0, help="the window without steps")
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.repeats, args.idle_s = 20, 2, 1.0
    if args.steps < 1 or args.repeats < 1:
        raise ValueError(f"need --steps and --repeats >= 1, got {args.steps}, {args.repeats}")
    torch.set_num_threads(1)
    lighthouse, addr = start_lighthouse()
    floor: Floor | None = None
    group: OneRankGroup | None = None
    try:
        floor, group = Floor(args.pace_ms / 1000), OneRankGroup(addr, args.pace_ms / 1000)
        contenders = {
            "manager": (group.step, loop_thread_id("torchft_manager_server_"), lighthouse.pid),
            "floor": (floor.step, floor.thread.native_id or 0, floor.child.pid),
        }
        for step, _, _ in contenders.values():  # warm-up: connections, first quorum
            for _ in range(20):
                step()
        results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in contenders}
        for r in range(args.repeats):
            for name in list(contenders)[:: 1 if r % 2 == 0 else -1]:
                step, loop_id, peer = contenders[name]
                results[name].append(block(step, loop_id, peer, args.steps))
        loops = {name: loop_id for name, (_, loop_id, _) in contenders.items()}
        before = {name: thread_cpu_ns(i) for name, i in loops.items()}
        time.sleep(args.idle_s)
        idle = {
            name: (thread_cpu_ns(i) - before[name]) / args.idle_s / 1e3 for name, i in loops.items()
        }
    finally:
        if group is not None:
            group.close()
        if floor is not None:
            floor.close()
        kill_tree(lighthouse.pid)
    rows = []
    for name, blocks in results.items():
        loop_us, training_us, peer_us = ([b[i] for b in blocks] for i in range(3))
        rows.append({
            "contender": name,
            "loop_us": round(statistics.median(loop_us)),
            "loop_range": f"{min(loop_us):.0f}-{max(loop_us):.0f}",
            "training_us": round(statistics.median(training_us)),
            "training_range": f"{min(training_us):.0f}-{max(training_us):.0f}",
            "peer_us": round(statistics.median(peer_us)),
            "idle_loop_us_per_s": round(idle[name]),
            "steps": args.steps,
            "repeats": args.repeats,
        })  # fmt: skip
    report(rows, results_file(args.out, "quorum_cpu"))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
