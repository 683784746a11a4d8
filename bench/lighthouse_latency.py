"""Lighthouse start-up time and quorum latency of N clients joining at once.

    python -m bench.lighthouse_latency [--clients 2 50] [--rounds 20] [--out DIR] [--smoke]

Start-up: from spawning `python -m lighthouse` to its "listening" log line.
Quorum latency: N threads, each with its own client, call Quorum at the same
moment (a barrier) with heartbeats on; the figure is the time until the last
one has its answer, median and min/max over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from bench._report import add_common_args, report, results_file
from lighthouse import LighthouseClient

REPO = Path(__file__).resolve().parent.parent


def start_lighthouse(min_replicas: int) -> tuple[subprocess.Popen, str, float]:
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lighthouse", "--min-replicas", str(min_replicas),
         "--bind", "127.0.0.1:0", "--http-bind", "", "--join-timeout-ms", "60000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, text=True,
    )  # fmt: skip
    for line in proc.stdout:
        if "listening on" in line:
            address = line.split("listening on ")[1].split()[0]
            took = time.perf_counter() - start
            # Keep reading, so a full pipe never blocks the lighthouse's logging.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, address, took
    raise RuntimeError("the lighthouse exited before listening")


def quorum_round(address: str, clients: list[LighthouseClient], round_id: int) -> float:
    barrier = threading.Barrier(len(clients) + 1)
    done: list[float] = []

    def join(i: int) -> None:
        barrier.wait()
        clients[i].quorum(f"r{i}", timedelta(seconds=30), step=round_id)
        done.append(time.perf_counter())

    threads = [threading.Thread(target=join, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join(60)
    return max(done) - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--clients", type=int, nargs="+", default=[2, 50])
    parser.add_argument("--rounds", type=int, default=20)
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.clients, args.rounds = [2], 3
    rows = []
    for n in args.clients:
        proc, address, startup_s = start_lighthouse(min_replicas=n)
        try:
            clients = [LighthouseClient(address) for _ in range(n)]
            for i, c in enumerate(clients):
                c.heartbeat(f"r{i}")  # all healthy: the quorum waits for all n
            quorum_round(address, clients, 0)  # warm-up: connections
            samples = [quorum_round(address, clients, r) for r in range(1, args.rounds + 1)]
        finally:
            proc.terminate()
            proc.wait(10)
        rows.append(
            {
                "clients": n,
                "startup_s": round(startup_s, 3),
                "quorum_median_ms": round(1000 * statistics.median(samples), 2),
                "quorum_min_ms": round(1000 * min(samples), 2),
                "quorum_max_ms": round(1000 * max(samples), 2),
            }
        )
    report(rows, results_file(args.out, "lighthouse_latency"))


if __name__ == "__main__":
    main()
