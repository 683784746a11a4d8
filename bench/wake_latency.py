"""How late a woken control thread runs on busy cores, under each scheduling policy.

    python -m bench.wake_latency [--wakes 2000] [--repeats 4] [--period-ms 10] [--busy N]
                                 [--out DIR] [--smoke]

Why: TORCHFT_LIKE_CONTROL_SCHED=batch runs the Manager's per-step threads
under SCHED_BATCH, so that, woken, they do not preempt a training thread
(bench/NOTES.md, "Sixth pass"). The price is that such a thread may wait
before it runs. Every timeout in the control path (heartbeats, joins,
freezes, store waits) is hundreds of milliseconds or more; this measures
the wait, so that a failure measured in those units can be told apart from
it.

One thread of this process sleeps `--period-ms` at a time, `--wakes` times
per block, and records how far past its deadline it ran, while `--busy`
child processes (default: one per core) spin. Blocks alternate between the
policies, the order flipping each repeat. Figures per policy, in
microseconds over all its wakes: median, p99, p99.9 and the largest.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import psutil

from bench._report import add_common_args, pct, report, results_file
from lighthouse.loop import set_batch_policy
from tools.procs import kill_tree

POLICIES = ("normal", "batch")


def overshoots_us(batch: bool, wakes: int, period_s: float) -> list[float]:
    """Each wake's lateness past its deadline, from a fresh thread under the policy."""
    out: list[float] = []

    def run() -> None:
        set_batch_policy(batch)
        for _ in range(wakes):
            deadline = time.monotonic() + period_s
            time.sleep(period_s)
            out.append((time.monotonic() - deadline) * 1e6)

    thread = threading.Thread(target=run, name=f"wake-{'batch' if batch else 'normal'}")
    thread.start()
    thread.join()
    return out


def wait_spinning(spinners: list[subprocess.Popen], timeout_s: float) -> None:
    """Returns once every spinner has run 0.1 s of CPU: the cores are busy."""
    deadline = time.monotonic() + timeout_s
    for proc in spinners:
        while psutil.Process(proc.pid).cpu_times().user < 0.1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"spinner {proc.pid} did not run within {timeout_s} s")
            time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--wakes", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--period-ms", type=float, default=10.0)
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 1)
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.wakes, args.repeats, args.period_ms = 50, 1, 2.0
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(args.busy)
    ]
    by_policy: dict[str, list[float]] = {p: [] for p in POLICIES}
    try:
        wait_spinning(spinners, timeout_s=30)
        for repeat in range(args.repeats):
            order = POLICIES if repeat % 2 == 0 else POLICIES[::-1]
            for policy in order:
                lateness = overshoots_us(policy == "batch", args.wakes, args.period_ms / 1000)
                by_policy[policy] += lateness
    finally:
        for proc in spinners:
            kill_tree(proc.pid)
            proc.wait()
    rows = [
        {
            "policy": policy,
            "busy": args.busy,
            "wakes": len(values),
            "period_ms": args.period_ms,
            "median_us": round(pct(values, 0.5)),
            "p99_us": round(pct(values, 0.99)),
            "p999_us": round(pct(values, 0.999)),
            "max_us": round(max(values)),
        }
        for policy, values in by_policy.items()
    ]
    report(rows, results_file(args.out, "wake_latency"))


if __name__ == "__main__":
    main()
