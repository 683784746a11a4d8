"""What a lighthouse restart costs the groups: SIGKILL, down, restart, first commit.

    python -m bench.lighthouse_restart [--groups 2] [--restarts 5] [--down-s 1.3]
        [--heartbeat-timeout-ms 5000 1000] [--no-state-file] [--out DIR] [--smoke]

Each replica group is its own process (one rank, a real Manager, gloo and a
small allreduce a step, --step-sleep between steps); the lighthouse is a
`python -m lighthouse` child, with a --state-file unless --no-state-file.
Once every group commits steadily, the lighthouse is SIGKILLed, restarted on
the same port --down-s later, and so on --restarts times per heartbeat
timeout. Reported, medians and worst over the restarts: `start_s` (spawn ->
the port accepts: the restart itself, Python and gRPC start-up), `commit_s`
(the port accepts -> every group committed a step again: what the restart
costs beyond itself) and `total_s` (spawn -> every group committed).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench._group_manager import one_rank_manager
from bench._report import REPO, add_common_args, report, results_file
from tools.procs import free_port, kill_tree, spawn


def group_main(lighthouse: str, group: int, step_sleep: float, out: Any, stop: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    import torchft_like as ft

    store, manager = one_rank_manager(ft, lighthouse, group, quorum_timeout=timedelta(seconds=60))
    grad = torch.ones(1024)
    while not stop.is_set():
        manager.start_quorum()
        manager.allreduce(grad).wait()
        if manager.should_commit():
            out.put((group, time.time(), manager.current_step()))
        time.sleep(step_sleep)
    manager.shutdown()


def start_lighthouse(
    port: int, args: argparse.Namespace, hb_ms: int, state_file: str | None, log: Path
) -> tuple[subprocess.Popen[bytes], float]:
    """Starts it; returns it and when its port accepted (epoch seconds)."""
    argv = [sys.executable, "-m", "lighthouse", "--min-replicas", "1",
            "--bind", f"127.0.0.1:{port}", "--http-bind", "", "--heartbeat-timeout-ms",
            str(hb_ms), "--join-timeout-ms", str(args.join_timeout_ms)]  # fmt: skip
    if state_file:
        argv += ["--state-file", state_file]
    proc = spawn(argv, open(log, "ab"), None, REPO)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, time.time()
        except OSError:
            time.sleep(0.005)
    raise RuntimeError(f"lighthouse did not start; see {log}")


def commits_after(out: Any, since: float, groups: int, timeout: float) -> float:
    """Waits until every group committed a step after `since`; returns when the last did."""
    first: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(first) < groups:
        group, t, _ = out.get(timeout=max(0.01, deadline - time.monotonic()))
        if t > since and group not in first:
            first[group] = t
    return max(first.values())


def run(args: argparse.Namespace, hb_ms: int, tmp: Path) -> list[dict[str, float]]:
    port = free_port()
    state_file = None if args.no_state_file else str(tmp / f"state-{hb_ms}.json")
    log = tmp / f"lighthouse-{hb_ms}.log"
    lighthouse, _ = start_lighthouse(port, args, hb_ms, state_file, log)
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    address = f"http://127.0.0.1:{port}"
    procs = [
        ctx.Process(target=group_main, args=(address, g, args.step_sleep, out, stop))
        for g in range(args.groups)
    ]
    for p in procs:
        p.start()
    samples = []
    try:
        commits_after(out, 0.0, args.groups, 120)
        for _ in range(args.restarts):
            time.sleep(1.0)  # steady again
            kill_tree(lighthouse.pid)
            lighthouse.wait()
            time.sleep(args.down_s)
            spawned = time.time()
            lighthouse, listening = start_lighthouse(port, args, hb_ms, state_file, log)
            while not out.empty():
                out.get_nowait()
            back = commits_after(out, listening, args.groups, 60)
            samples.append({"start_s": listening - spawned, "commit_s": back - listening,
                            "total_s": back - spawned})  # fmt: skip
    finally:
        stop.set()
        for p in procs:
            p.join(15)
            if p.is_alive():
                p.kill()
                p.join()
        kill_tree(lighthouse.pid)
        lighthouse.wait()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--down-s", type=float, default=1.3, help="seconds the lighthouse is down")
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--heartbeat-timeout-ms", type=int, nargs="+", default=[5000, 1000])
    parser.add_argument("--join-timeout-ms", type=int, default=60000, help="lighthouse option")
    parser.add_argument("--no-state-file", action="store_true", help="run without --state-file")
    parser.add_argument(
        "--logs", default=None, help="keep the lighthouse logs here (default: none)"
    )
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.restarts, args.heartbeat_timeout_ms = 1, [1000]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(args.logs) if args.logs else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for hb_ms in args.heartbeat_timeout_ms:
            samples = run(args, hb_ms, logs)
            row: dict[str, object] = {"heartbeat_timeout_ms": hb_ms, "groups": args.groups,
                                      "state_file": not args.no_state_file,
                                      "restarts": len(samples)}  # fmt: skip
            for key in ("start_s", "commit_s", "total_s"):
                values = [s[key] for s in samples]
                row[f"{key}_median"] = round(statistics.median(values), 3)
                row[f"{key}_worst"] = round(max(values), 3)
            rows.append(row)
    report(rows, results_file(args.out, "lighthouse_restart"))


if __name__ == "__main__":
    main()
