"""Lighthouse under load: N replica groups heartbeating and asking for quorums.

    python -m bench.lighthouse_load [--groups 10 100 300 1000] [--seconds 15]
    python -m bench.lighthouse_load --smoke      # a few seconds, tiny config

Each simulated group is an asyncio gRPC client with its own connection; the
groups are spread over --procs load processes. A group heartbeats every
--heartbeat-ms and calls Quorum once per --step-s "step" (all groups call at
the same step boundary, as synchronous training does). Any server of the
torchft wire protocol can be driven, so one run measures, interleaved:

- `ref`: pytorch/torchft's Rust lighthouse (.venv/bin/torchft_lighthouse),
- `ours`: torchft-lighthouse with unary Heartbeat calls,
- `ours_stream`: torchft-lighthouse with the HeartbeatStream RPC.

Reported over the measurement window (after one warm-up step): quorum call
latency p50/p99, heartbeat latency p99 (unary: the call; stream: the write,
which only waits for flow control), heartbeats per second completed vs
offered, the lighthouse's CPU (psutil cpu_times, fraction of one core) and
RSS, the load processes' own CPU (they share the machine's cores with the
lighthouse), and errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

from bench._report import REPO, report

CONTENDERS = ("ref", "ours", "ours_stream")


# ---- load process ------------------------------------------------------------


async def _group(
    gid: int, target: str, cfg: dict, stats: dict, t0: float, w0: float, w1: float
) -> None:
    import grpc
    from grpc import aio

    from lighthouse._proto import torchft_pb2 as pb
    from lighthouse._proto import torchft_pb2_grpc as pb_grpc

    # A channel (and TCP connection) of its own, as a real group has: without
    # a local subchannel pool, channels to one target share one connection.
    channel = aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    stub = pb_grpc.LighthouseServiceStub(channel)
    rid = f"group{gid}:{os.getpid()}"
    hb_s = cfg["heartbeat_ms"] / 1000
    stop_at = w1 + 0.2

    def in_window(t: float) -> bool:
        return w0 <= t < w1

    async def heartbeats() -> None:
        req = pb.LighthouseHeartbeatRequest(replica_id=rid)
        await asyncio.sleep(random.random() * hb_s)
        call = stub.HeartbeatStream() if cfg["stream"] else None
        nxt = time.time()
        while time.time() < stop_at:
            start = time.time()
            try:
                if call is not None:
                    await call.write(req)
                else:
                    await stub.Heartbeat(req, timeout=5)
                if in_window(start):
                    stats["hb_lat"].append(time.time() - start)
                    stats["hb_ok"] += 1
            except (grpc.RpcError, asyncio.InvalidStateError) as e:
                if in_window(start):
                    stats["errors"].append(f"heartbeat: {str(e)[:200]}")
                if call is not None:
                    call = stub.HeartbeatStream()
            nxt += hb_s
            await asyncio.sleep(max(0.0, nxt - time.time()))
        if call is not None:
            call.cancel()

    async def quorums() -> None:
        step = 0
        while True:
            at = t0 + step * cfg["step_s"]
            if at >= w1:
                return
            await asyncio.sleep(max(0.0, at - time.time()))
            member = pb.QuorumMember(replica_id=rid, address=f"http://g{gid}", step=step)
            start = time.time()
            try:
                await stub.Quorum(pb.LighthouseQuorumRequest(requester=member), timeout=30)
                if in_window(start):
                    stats["q_lat"].append(time.time() - start)
            except grpc.RpcError as e:
                if in_window(start):
                    stats["errors"].append(f"quorum: {str(e)[:200]}")
            step = max(step + 1, int((time.time() - t0) / cfg["step_s"]) + 1)

    try:
        await asyncio.gather(heartbeats(), quorums())
    finally:
        await channel.close()


async def _load(cfg: dict) -> dict:
    stats: dict = {"hb_lat": [], "q_lat": [], "hb_ok": 0, "errors": []}
    t0, w0, w1 = cfg["t0"], cfg["w0"], cfg["w1"]
    me = psutil.Process()
    tasks = [
        asyncio.create_task(_group(g, cfg["target"], cfg, stats, t0, w0, w1)) for g in cfg["gids"]
    ]
    await asyncio.sleep(max(0.0, w0 - time.time()))
    c0 = me.cpu_times()
    await asyncio.sleep(max(0.0, w1 - time.time()))
    c1 = me.cpu_times()
    await asyncio.gather(*tasks, return_exceptions=True)
    stats["cpu_s"] = (c1.user + c1.system) - (c0.user + c0.system)
    return stats


def load_main(cfg_json: str) -> None:
    cfg = json.loads(cfg_json)
    print(json.dumps(asyncio.run(_load(cfg))), flush=True)


# ---- driver ------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(contender: str, n: int, port: int) -> subprocess.Popen:
    if contender == "ref":
        exe = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
        args = [exe, "--min_replicas", str(n), "--bind", f"127.0.0.1:{port}"]
    else:
        args = [sys.executable, "-m", "lighthouse", "--min-replicas", str(n),
                "--bind", f"127.0.0.1:{port}", "--http-bind", "",
                "--log-level", "WARNING"]  # fmt: skip
    args += ["--join_timeout_ms", "60000", "--heartbeat_timeout_ms", "5000"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{contender} lighthouse did not start listening on port {port}")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_one(contender: str, n: int, args: argparse.Namespace) -> dict:
    port = free_port()
    server = start_server(contender, n, port)
    loads: list[subprocess.Popen] = []
    try:
        sp = psutil.Process(server.pid)
        procs = max(1, min(args.procs, n))
        # Time to connect everyone, then one warm-up step before the window.
        t0 = time.time() + 1.0 + n / 500
        w0 = t0 + args.step_s * args.warmup_steps
        w1 = w0 + args.seconds
        for p in range(procs):
            cfg = {
                "target": f"127.0.0.1:{port}",
                "gids": list(range(p, n, procs)),
                "stream": contender == "ours_stream",
                "heartbeat_ms": args.heartbeat_ms,
                "step_s": args.step_s,
                "t0": t0,
                "w0": w0,
                "w1": w1,
            }
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench.lighthouse_load", "--load-process", json.dumps(cfg)],
                stdout=subprocess.PIPE, cwd=REPO, text=True,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )  # fmt: skip
            loads.append(proc)
        time.sleep(max(0.0, w0 - time.time()))
        s0 = sp.cpu_times()
        time.sleep(max(0.0, w1 - time.time()))
        s1 = sp.cpu_times()
        rss_mb = sp.memory_info().rss / 2**20
        results = []
        for proc in loads:
            out, _ = proc.communicate(timeout=args.seconds + 60)
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in loads:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        server.kill()
        server.wait(10)
    q = [x for r in results for x in r["q_lat"]]
    hb = [x for r in results for x in r["hb_lat"]]
    errors = [e for r in results for e in r["errors"]]
    if errors:
        print(f"{contender} n={n}: {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
    return {
        "n": n,
        "server": contender,
        "q_p50_ms": round(1000 * pct(q, 0.5), 1),
        "q_p99_ms": round(1000 * pct(q, 0.99), 1),
        "quorums": len(q),
        "hb_p99_ms": round(1000 * pct(hb, 0.99), 2),
        "hb_per_s": round(sum(r["hb_ok"] for r in results) / args.seconds),
        "hb_offered": round(n * 1000 / args.heartbeat_ms),
        "lh_cpu": round((s1.user + s1.system - s0.user - s0.system) / args.seconds, 2),
        "lh_rss_mb": round(rss_mb, 1),
        "load_cpu": round(sum(r["cpu_s"] for r in results) / args.seconds, 2),
        "errors": len(errors),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[10, 100, 300, 1000])
    parser.add_argument("--servers", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    parser.add_argument("--seconds", type=float, default=15, help="window per run (default 15)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (default 1)")
    parser.add_argument("--procs", type=int, default=4, help="load processes (default 4)")
    parser.add_argument("--heartbeat-ms", type=int, default=100)
    parser.add_argument("--step-s", type=float, default=1.0)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="10 groups, 3 s, one load process")
    parser.add_argument("--results", default="bench_results/lighthouse_load.jsonl")
    parser.add_argument("--load-process", metavar="CONFIG_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_process:
        load_main(args.load_process)
        return
    if args.smoke:
        args.groups, args.seconds, args.procs, args.warmup_steps = [10], 3, 1, 1
    rows = []
    for n in args.groups:
        for _ in range(args.rounds):
            for contender in args.servers:
                row = run_one(contender, n, args)
                print(json.dumps(row), file=sys.stderr)
                rows.append(row)
    report(rows, args.results)
    if args.rounds > 1:
        for n in args.groups:
            for c in args.servers:
                p99 = [r["q_p99_ms"] for r in rows if r["n"] == n and r["server"] == c]
                print(f"n={n} {c}: quorum p99 median {statistics.median(p99)} ms "
                      f"(min {min(p99)}, max {max(p99)})")  # fmt: skip


if __name__ == "__main__":
    main()
