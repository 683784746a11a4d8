"""The Manager's per-step cost with no model: start_quorum + should_commit.

    python -m bench.control_plane [--groups 2 8] [--steps 300] [--repeats 2] [--out DIR] [--smoke]

Each replica group is its own process (one rank, its own TCPStore) with a
real Manager, gloo process group and lighthouse; the lighthouse runs in this
process. Contenders, interleaved (A B A B): ft = torchft_like's Manager and
lighthouse; torchft = pytorch/torchft's (its Rust lighthouse), only when
`import torchft` works (the `bench` extra). Per-step time is measured on
group 0 after 20 warm-up steps; reported as the median over all measured
steps, min/max of the per-run medians, group 0's process CPU per step
(median of the runs), and the RPCs a step sends (heartbeats left out;
torchft's lighthouse call from its Rust server is added, not counted).
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import statistics
import time

from bench import _rpc_count
from bench._group_manager import one_rank_manager
from bench._report import add_common_args, report, results_file

WARMUP = 20
TORCHFT_LIGHTHOUSE_RPCS = 1
"""See bench.step_overhead: torchft's server-side lighthouse call, one a step."""


def group_main(mode: str, lighthouse: str, group: int, steps: int, out: mp.Queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    _rpc_count.install()

    if mode == "ft":
        import torchft_like as ft
    else:
        import torchft as ft  # type: ignore[no-redef]

    store, manager = one_rank_manager(ft, lighthouse, group)
    if mode == "torchft":
        rpcs = {"_quorum": "Quorum", "should_commit": "ShouldCommit"}
        manager._client = _rpc_count.CountingProxy(manager._client, rpcs)
    times = []
    before = {}
    cpu = 0.0
    while manager.current_step() < steps:
        if len(times) == WARMUP:
            before = _rpc_count.snapshot()
            cpu = time.process_time()
        start = time.perf_counter()
        manager.start_quorum()
        manager.wait_quorum()
        manager.should_commit()
        times.append(time.perf_counter() - start)
    measured = len(times) - WARMUP
    cpu_per_step = (time.process_time() - cpu) / measured
    rpcs = _rpc_count.critical_per_step(before, _rpc_count.snapshot(), measured)
    manager.shutdown()
    out.put((group, times[WARMUP:], rpcs, cpu_per_step))


def start_lighthouse(mode: str, groups: int):  # type: ignore[no-untyped-def]
    if mode == "ft":
        from lighthouse import LighthouseServer

        return LighthouseServer(bind="127.0.0.1:0", min_replicas=groups)
    from torchft.coordination import LighthouseServer as TorchftLighthouse

    return TorchftLighthouse(bind="127.0.0.1:0", min_replicas=groups)


def run(mode: str, groups: int, steps: int) -> tuple[list[float], float, float]:
    """One run; returns group 0's per-step seconds, RPCs per step and CPU
    seconds per step (its process, all threads: the Manager's own cost;
    torchft's Rust threads included)."""
    lighthouse = start_lighthouse(mode, groups)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=group_main, args=(mode, lighthouse.address(), g, steps, out))
        for g in range(groups)
    ]
    for p in procs:
        p.start()
    try:
        results = {g: rest for g, *rest in (out.get(timeout=600) for _ in procs)}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        lighthouse.shutdown()
    times, rpcs, cpu = results[0]
    return times, rpcs + (TORCHFT_LIGHTHOUSE_RPCS if mode == "torchft" else 0), cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--contenders", nargs="+", default=["ft", "torchft"],
        help="ft and torchft (skipped when torchft is not installed)",
    )  # fmt: skip
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.groups, args.steps, args.repeats, args.contenders = [2], WARMUP + 10, 1, ["ft"]
    have_torchft = importlib.util.find_spec("torchft") is not None
    contenders = [m for m in args.contenders if m != "torchft" or have_torchft]
    rows = []
    for groups in args.groups:
        samples: dict[str, list[list[float]]] = {m: [] for m in contenders}
        rpcs: dict[str, list[float]] = {m: [] for m in contenders}
        cpus: dict[str, list[float]] = {m: [] for m in contenders}
        for _ in range(args.repeats):
            for mode in contenders:
                times, per_step, cpu = run(mode, groups, args.steps)
                samples[mode].append(times)
                rpcs[mode].append(per_step)
                cpus[mode].append(cpu)
        for mode in contenders:
            medians = [statistics.median(s) for s in samples[mode]]
            row = {
                "contender": mode,
                "groups": groups,
                "median_ms": round(1000 * statistics.median(sum(samples[mode], [])), 3),
                "run_medians_min_max_ms": f"{1000 * min(medians):.2f}-{1000 * max(medians):.2f}",
                "cpu_ms_per_step": round(1000 * statistics.median(cpus[mode]), 3),
                "steps": sum(len(s) for s in samples[mode]),
                "rpcs_per_step": round(statistics.median(rpcs[mode]), 2),
            }
            if mode != contenders[0]:
                ratios = [b / a for a, b in zip(
                    (statistics.median(s) for s in samples[contenders[0]]), medians)]  # fmt: skip
                row[f"ratio_to_{contenders[0]}"] = round(statistics.median(ratios), 3)
            else:
                row[f"ratio_to_{contenders[0]}"] = 1.0
            rows.append(row)
    report(rows, results_file(args.out, "control_plane"))


if __name__ == "__main__":
    main()
