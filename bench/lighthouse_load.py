"""Lighthouse under load: N replica groups heartbeating and asking for quorums.

    python -m bench.lighthouse_load [--groups 10 100 300 1000] [--seconds 15]
    python -m bench.lighthouse_load --smoke      # a few seconds, tiny config

Each simulated group is an asyncio gRPC client with its own connection; the
groups are spread over --procs load processes. A group heartbeats every
--heartbeat-ms and calls Quorum once per --step-s "step": all groups ask at
the same step boundary, as synchronous training does, and every group asks
for every step, late or not. After a warm-up quorum that every group is in
(connecting a thousand takes a while on a loaded box) and --warmup-steps,
the window of --seconds starts. Any server of the torchft wire protocol can
be driven, so one run measures, interleaved per N:

- `ref`: pytorch/torchft's Rust lighthouse (.venv/bin/torchft_lighthouse),
- `ours`: torchft-lighthouse with unary Heartbeat calls,
- `ours_grpcio`: the same served by grpcio's server (`--rpc-server grpcio`)
  instead of our lean one,
- `ours_stream`: torchft-lighthouse with the HeartbeatStream RPC,
- `ours_paced`: torchft-lighthouse with HeartbeatPaced, each group
  heartbeating at the longer of --heartbeat-ms and the lighthouse's advice
  (lighthouse.core.pacing), as our ManagerServer does; hb_offered then still
  says what --heartbeat-ms would offer.

Columns: quorum call latency p50/p99 (q_*: from the call; q_last_p99: from
the step's last call, the lighthouse's own part); heartbeat latency p99
(unary: the call; stream: the write, which only waits for flow control);
heartbeats per second completed vs offered; the lighthouse's CPU (psutil
cpu_times over the window, fraction of one core), its CPU per call
(us_per_rpc: that CPU over the heartbeats and Quorum calls of the window) and
RSS; the load processes' own CPU, which competes with the lighthouse on a
small box; errors. --profile DIR records py-spy flame data of our servers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

from bench._report import REPO, add_common_args, pct, report, results_file
from tools.procs import free_port, wait_listening

CONTENDERS = ("ref", "ours", "ours_grpcio", "ours_stream", "ours_paced")
VENV_BIN = Path(sys.executable).parent


# ---- load process ------------------------------------------------------------


def _why(e: Exception) -> str:
    if hasattr(e, "code"):
        return f"{e.code().name} {e.details()}"[:300]
    return f"{type(e).__name__} {e}"[:300]


class _Clock:
    """The measurement window, set by the driver once every group is ready."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.t0 = self.w0 = self.w1 = float("inf")
        self.steps = self.warmup_steps = 0

    def in_window(self, t: float) -> bool:
        return self.w0 <= t < self.w1


async def _group(gid: int, cfg: dict, stats: dict, clock: _Clock, ready: asyncio.Queue) -> None:
    import grpc
    from grpc import aio

    from lighthouse.rpc.proto import torchft_pb2 as pb
    from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc

    # A channel (and TCP connection) of its own, as a real group has: without
    # a local subchannel pool, channels to one target share one connection.
    channel = aio.insecure_channel(cfg["target"], options=[("grpc.use_local_subchannel_pool", 1)])
    stub = pb_grpc.LighthouseServiceStub(channel)
    rid = f"group{gid}:{os.getpid()}"
    done = asyncio.Event()
    hb_s = cfg["heartbeat_ms"] / 1000
    readers: list[asyncio.Task] = []

    advice = {"s": 0.0}

    async def read_advice(call: aio.StreamStreamCall) -> None:
        try:
            async for answer in call:
                advice["s"] = answer.interval_ms / 1000
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass

    def open_stream() -> aio.Call | None:
        if cfg["mode"] == "paced":
            call = stub.HeartbeatPaced()
            readers.append(asyncio.create_task(read_advice(call)))
            return call
        return stub.HeartbeatStream() if cfg["mode"] == "stream" else None

    async def heartbeats() -> None:
        req = pb.LighthouseHeartbeatRequest(replica_id=rid)
        await asyncio.sleep(random.random() * hb_s)
        call = open_stream()
        nxt = time.time()
        while not done.is_set():
            start = time.time()
            try:
                if call is not None:
                    await call.write(req)
                else:
                    await stub.Heartbeat(req, timeout=5)
                if clock.in_window(start):
                    stats["hb_lat"].append(time.time() - start)
                    stats["hb_ok"] += 1
            except (grpc.RpcError, asyncio.InvalidStateError) as e:
                if clock.in_window(start):
                    stats["errors"].append(f"heartbeat: {_why(e)}")
                if call is not None:
                    call = open_stream()
            period = max(hb_s, advice["s"])
            nxt = max(nxt + period, time.time() - period)
            await asyncio.sleep(max(0.0, nxt - time.time()))
        if call is not None:
            call.cancel()

    async def ask(step: int, timeout: float = 60) -> None:
        member = pb.QuorumMember(replica_id=rid, address=f"http://g{gid}", step=step)
        await stub.Quorum(pb.LighthouseQuorumRequest(requester=member), timeout=timeout)

    async def quorums() -> None:
        # Warm-up: connected, and in the first quorum; a thousand connecting
        # at once on a loaded 2-core box can take a while.
        await ask(0, timeout=600)
        await ready.put(gid)
        await clock.go.wait()
        # Every group asks for every step, late or not: a group that skipped
        # a step would leave the others waiting for it.
        for step in range(1, clock.steps + 1):
            at = clock.t0 + (step - 1) * cfg["step_s"]
            await asyncio.sleep(max(0.0, at - time.time()))
            start = time.time()
            if clock.in_window(start):
                stats["q_calls"] += 1
            try:
                await ask(step)
                if clock.warmup_steps < step < clock.steps:  # the last one closes the window
                    stats["quorums"].append((step, start, time.time()))
            except grpc.RpcError as e:
                stats["errors"].append(f"quorum: {_why(e)}")
        done.set()

    try:
        await asyncio.gather(heartbeats(), quorums())
    finally:
        for reader in readers:
            reader.cancel()
        await channel.close()


async def _load(cfg: dict) -> dict:
    """One load process: its groups, the ready/go handshake, its own CPU."""
    stats: dict = {"hb_lat": [], "quorums": [], "hb_ok": 0, "q_calls": 0, "errors": []}
    clock = _Clock()
    ready: asyncio.Queue = asyncio.Queue()
    me = psutil.Process()
    tasks = []
    for g in cfg["gids"]:  # paced: no connection storm
        tasks.append(asyncio.create_task(_group(g, cfg, stats, clock, ready)))
        await asyncio.sleep(0.005)
    for _ in cfg["gids"]:
        await ready.get()
    print("ready", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    clock.t0, clock.w0, clock.w1, clock.steps, clock.warmup_steps = json.loads(line)
    clock.go.set()
    await asyncio.sleep(max(0.0, clock.w0 - time.time()))
    c0 = me.cpu_times()
    await asyncio.sleep(max(0.0, clock.w1 - time.time()))
    c1 = me.cpu_times()
    await asyncio.gather(*tasks, return_exceptions=True)
    stats["cpu_s"] = (c1.user + c1.system) - (c0.user + c0.system)
    return stats


def load_main(cfg_json: str) -> None:
    cfg = json.loads(cfg_json)
    print(json.dumps(asyncio.run(_load(cfg))), flush=True)


# ---- driver ------------------------------------------------------------------


def start_server(contender: str, n: int, port: int, log: str | None) -> subprocess.Popen:
    if contender == "ref":
        exe = shutil.which("torchft_lighthouse", path=str(VENV_BIN))
        args = [exe, "--min_replicas", str(n), "--bind", f"127.0.0.1:{port}"]
    else:
        args = [sys.executable, "-m", "lighthouse", "--min-replicas", str(n),
                "--bind", f"127.0.0.1:{port}", "--http-bind", "",
                "--log-level", "INFO" if log else "WARNING"]  # fmt: skip
        args += ["--rpc-server", "grpcio" if contender == "ours_grpcio" else "lean"]
    args += ["--join_timeout_ms", "60000", "--heartbeat_timeout_ms", "5000"]
    out = open(f"{log}.{contender}.{n}", "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(args, stdout=out, stderr=out, cwd=REPO)
    try:
        wait_listening(port, proc, f"{contender} lighthouse")
    except RuntimeError:
        proc.kill()
        raise
    return proc


def _profile(pid: int, contender: str, n: int, args: argparse.Namespace) -> subprocess.Popen | None:
    """py-spy over our lighthouse for most of the window, with --profile DIR."""
    if not args.profile or contender == "ref":
        return None
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(VENV_BIN))
    if spy is None:
        raise RuntimeError("--profile needs py-spy on PATH")
    out = Path(args.profile) / f"{contender}.{n}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    secs = max(1, int(args.seconds) - 2)
    cmd = [spy, "record", "-p", str(pid), "-d", str(secs), "-r", "100", "-f", "raw", "-o", str(out)]
    cmd += ["--native"] if args.profile_native else []
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_one(contender: str, n: int, args: argparse.Namespace) -> dict:
    port = free_port()
    server = start_server(contender, n, port, args.server_log)
    loads: list[subprocess.Popen] = []
    try:
        sp = psutil.Process(server.pid)
        procs = max(1, min(args.procs, n))
        for p in range(procs):
            cfg = {
                "target": f"127.0.0.1:{port}",
                "gids": list(range(p, n, procs)),
                "mode": {"ours_stream": "stream", "ours_paced": "paced"}.get(contender, "unary"),
                "heartbeat_ms": args.heartbeat_ms,
                "step_s": args.step_s,
            }
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench.lighthouse_load", "--load-process", json.dumps(cfg)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, text=True,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )  # fmt: skip
            loads.append(proc)
        for proc in loads:  # every group connected and in the first quorum
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a load process for {contender} n={n} failed")
        t0 = time.time() + 0.3
        w0 = t0 + args.step_s * args.warmup_steps
        w1 = w0 + args.seconds
        for proc in loads:
            steps = args.warmup_steps + round(args.seconds / args.step_s) + 1
            proc.stdin.write(json.dumps([t0, w0, w1, steps, args.warmup_steps]) + "\n")
            proc.stdin.flush()
        time.sleep(max(0.0, w0 - time.time()))
        s0 = sp.cpu_times()
        spy = _profile(server.pid, contender, n, args)
        time.sleep(max(0.0, w1 - time.time()))
        s1 = sp.cpu_times()
        if spy is not None:
            spy.wait(30)
        rss_mb = sp.memory_info().rss / 2**20
        results = [json.loads(proc.stdout.read().strip().splitlines()[-1]) for proc in loads]
    finally:
        for proc in loads:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        server.kill()
        server.wait(10)
    calls = [tuple(x) for r in results for x in r["quorums"]]
    q = [end - start for _, start, end in calls]
    # The lighthouse's own part: from the step's last call to each answer.
    last_call: dict[int, float] = {}
    for step, start, _ in calls:
        last_call[step] = max(last_call.get(step, 0.0), start)
    q_after_last = [end - last_call[step] for step, _, end in calls]
    hb = [x for r in results for x in r["hb_lat"]]
    lh_cpu_s = s1.user + s1.system - s0.user - s0.system
    # Calls started in the window: every heartbeat (unary or stream message) and Quorum.
    rpcs = sum(r["hb_ok"] + r["q_calls"] for r in results)
    errors = [e for r in results for e in r["errors"]]
    if errors:
        print(f"{contender} n={n}: {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
    return {
        "n": n,
        "server": contender,
        "q_p50_ms": round(1000 * pct(q, 0.5), 1),
        "q_p99_ms": round(1000 * pct(q, 0.99), 1),
        "q_last_p99_ms": round(1000 * pct(q_after_last, 0.99), 1),
        "quorums": len(q),
        "hb_p99_ms": round(1000 * pct(hb, 0.99), 2),
        "hb_per_s": round(sum(r["hb_ok"] for r in results) / args.seconds),
        "hb_offered": round(n * 1000 / args.heartbeat_ms),
        "lh_cpu": round(lh_cpu_s / args.seconds, 2),
        "us_per_rpc": round(1e6 * lh_cpu_s / max(rpcs, 1)),
        "lh_rss_mb": round(rss_mb, 1),
        "load_cpu": round(sum(r["cpu_s"] for r in results) / args.seconds, 2),
        "errors": len(errors),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--groups", type=int, nargs="+", default=[10, 100, 300, 1000])
    parser.add_argument("--servers", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    parser.add_argument("--seconds", type=float, default=15, help="window per run (default 15)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (default 1)")
    parser.add_argument("--procs", type=int, default=4, help="load processes (default 4)")
    parser.add_argument("--heartbeat-ms", type=int, default=100)
    parser.add_argument("--step-s", type=float, default=1.0)
    parser.add_argument("--warmup-steps", type=int, default=1)
    add_common_args(parser)  # --smoke: 10 groups, 3 s, one load process
    parser.add_argument("--server-log", help="write each server's log to SERVER_LOG.NAME.N")
    parser.add_argument("--profile", metavar="DIR", help="py-spy each of our servers into DIR")
    parser.add_argument("--profile-native", action="store_true", help="py-spy --native")
    parser.add_argument("--load-process", metavar="CONFIG_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_process:
        load_main(args.load_process)
        return
    if args.smoke:
        args.groups, args.seconds, args.procs, args.warmup_steps = [10], 2, 1, 0
        # grpcio's server answers as the lean one does (tests/unit/test_lean_server.py).
        args.servers = [s for s in args.servers if s != "ours_grpcio"]
    if "ref" in args.servers and not shutil.which("torchft_lighthouse", path=str(VENV_BIN)):
        print("pytorch/torchft is not installed (pip install -e '.[bench]'): no `ref` contender")
        args.servers.remove("ref")
    rows = []
    for n in args.groups:
        for _ in range(args.rounds):
            for contender in args.servers:
                row = run_one(contender, n, args)
                print(json.dumps(row), file=sys.stderr)
                rows.append(row)
    report(rows, results_file(args.out, "lighthouse_load"))
    if args.rounds > 1:
        for n in args.groups:
            for c in args.servers:
                p99 = [r["q_p99_ms"] for r in rows if r["n"] == n and r["server"] == c]
                print(f"n={n} {c}: quorum p99 median {statistics.median(p99)} ms "
                      f"(min {min(p99)}, max {max(p99)})")  # fmt: skip


if __name__ == "__main__":
    main()
