"""The Manager's per-step cost with no model: start_quorum + should_commit.

    python -m bench.control_plane [--groups 2 8] [--steps 300]

Each replica group is its own process (one rank, its own TCPStore) with a
real Manager, gloo process group and lighthouse; the lighthouse runs in this
process. Per-step time is measured on group 0 after 20 warm-up steps.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from datetime import timedelta

from bench._report import report


def group_main(lighthouse: str, group: int, steps: int, out: mp.Queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    from torch.distributed import TCPStore

    from torchft_like import Manager, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
        min_replica_size=1,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"bench{group}",
        hostname="127.0.0.1",
        init_sync=False,  # no model: nothing to sync, and no allreduce to fence a transfer
    )
    times = []
    while manager.current_step() < steps:
        start = time.perf_counter()
        manager.start_quorum()
        manager.wait_quorum()
        manager.should_commit()
        times.append(time.perf_counter() - start)
    manager.shutdown()
    out.put((group, times[20:]))


def run(groups: int, steps: int) -> list[float]:
    from lighthouse import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=groups)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=group_main, args=(lighthouse.address(), g, steps, out))
        for g in range(groups)
    ]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--results", default="bench_results/control_plane.jsonl")
    args = parser.parse_args()
    rows = []
    for groups in args.groups:
        samples = run(groups, args.steps)
        rows.append(
            {
                "groups": groups,
                "median_ms": round(1000 * statistics.median(samples), 3),
                "min_ms": round(1000 * min(samples), 3),
                "max_ms": round(1000 * max(samples), 3),
                "steps": len(samples),
            }
        )
    report(rows, args.results)


if __name__ == "__main__":
    main()
