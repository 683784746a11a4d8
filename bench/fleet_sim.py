"""A fleet we cannot start here, simulated: the lighthouse's real membership
logic driven by 1,000 to 100,000 simulated replica groups on a virtual clock.

    python -m bench.fleet_sim --sizes 1000,3000,10000 --seconds 60 --seed 0
    python -m bench.fleet_sim --quick      # < 20 s: 300, 1000 groups, MTBF 1 h (--smoke: CI)

Every heartbeat, Quorum call, stream end, tick, decision and spare request
is a call of lighthouse.core.membership (the server's own state machine, which
runs lighthouse.core.quorum's rule and lighthouse.core.spares' placement); everything
else (processes, steps, failures, restarts, spares) is a discrete-event
simulation (bench._fleet_engine) with a seeded failure model
(bench._fleet_model). See docs/fleet.md for the method and the results.

Per fleet size, one run with failures and spares measures the real CPU cost
of each membership call (`*_us`: median and p99), the lighthouse's CPU per
simulated second (`cpu_core`: above 1.0 one process no longer keeps up;
`est_core` adds --rpc-us of transport per heartbeat or Quorum RPC, the
real server's measured cost outside the membership),
the quorum latency (virtual wait from the last member's call to the issue,
plus the measured cost of the deciding call), the step period and the
membership state's memory. For sizes up to --goodput-max, two more runs
(fault-free, and failures without spares) give the goodput: group-steps
trained over those of the fault-free fleet in the same window.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench._fleet_engine import Fleet, FleetConfig, FleetResult, state_memory_bytes
from bench._fleet_model import FAULT_FREE, FailureModel
from bench._report import add_common_args, report, results_file


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of `values`; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def goodput(run: FleetResult, fault_free: FleetResult) -> float:
    """Group-steps `run` trained over those the fault-free fleet trained in the same window."""
    ideal = fault_free.config.n_groups * fault_free.fleet_steps
    return run.trained / ideal if ideal else math.nan


def _us(values: list[float] | None, q: float) -> float:
    return round(quantile(values or [], q) * 1e6, 1)


RPC_US = 27.0
"""Real lighthouse CPU per RPC outside the membership calls (HTTP/2, asyncio,
protobuf), calibrated from bench.lighthouse_scale on this machine: 0.175-0.179
core at 10,000 groups with 5 s steps, over 2,000 Quorum calls and 4,490 paced
stream heartbeats a second, is 27 us per RPC with the membership calls in
it (docs/fleet.md, "Measured with real processes"; 36 us on 2026-11-28 at
00:50, 80 us before the parked calls and the collector's tuning, and
grpcio's server was 460 us)."""


def cost_row(n: int, run: FleetResult, memory: int, rpc_us: float = RPC_US) -> dict[str, Any]:
    """The costs, rates and latencies of one run, as a table row."""
    window = run.window_s
    costs = run.costs
    rpcs = sum(len(costs.get(k, [])) for k in ("heartbeat", "join", "spare_waits"))
    issued = [t for t in run.issued_at if t >= run.config.warmup_s]
    periods = [b - a for a, b in zip(issued, issued[1:])]
    return {
        "groups": n,
        "sim_s": run.config.seconds,
        "hb_per_s": round(len(costs.get("heartbeat", [])) / window),
        "hb_us_p50": _us(costs.get("heartbeat"), 0.5),
        "hb_us_p99": _us(costs.get("heartbeat"), 0.99),
        "join_us_p50": _us(costs.get("join"), 0.5),
        "decide_us_p50": _us(costs.get("decide"), 0.5),
        "decide_us_p99": _us(costs.get("decide"), 0.99),
        "tick_us_p50": _us(costs.get("tick"), 0.5),
        "quorums": len(issued),
        "cpu_ms_per_quorum": round(1e3 * run.cpu_s() / len(issued), 2) if issued else math.nan,
        "cpu_core": round(run.cpu_s() / window, 3),
        "rpc_per_s": round(rpcs / window),
        "est_core": round(run.cpu_s() / window + rpcs / window * rpc_us / 1e6, 2),
        "lat_ms_p50": round(1e3 * quantile(run.latency_s, 0.5), 2),
        "lat_ms_p90": round(1e3 * quantile(run.latency_s, 0.9), 2),
        "lat_ms_p99": round(1e3 * quantile(run.latency_s, 0.99), 2),
        "step_s_p50": round(quantile(periods, 0.5), 3),
        "mem_mb": round(memory / 2**20, 1),
    }


def goodput_row(
    n: int, free: FleetResult, bare: FleetResult, spared: FleetResult
) -> dict[str, Any]:
    return {
        "groups": n,
        "window_s": free.window_s,
        "steps_fault_free": free.fleet_steps,
        "failures": spared.failures,
        "steps_lost": spared.failed_steps,
        "goodput_no_spares": round(goodput(bare, free), 4),
        "goodput_spares": round(goodput(spared, free), 4),
        "promotions": spared.promotions,
    }


def keeping_up(rows: list[dict[str, Any]], key: str = "cpu_core") -> str:
    """Where one lighthouse process stops keeping up (`key` over 1 core per
    simulated second): measured, or extrapolated from the two largest sizes
    by a power law (CPU per second ~ groups^b)."""
    over = [r["groups"] for r in rows if r[key] > 1.0]
    if over:
        return f"{key}: over 1 core from {min(over)} groups (measured)"
    if len(rows) < 2:
        return f"{key}: one size only, no extrapolation"
    a, b = rows[-2], rows[-1]
    if a[key] <= 0 or b[key] <= a[key]:
        return f"{key}: did not grow with the fleet, no extrapolation"
    exp = math.log(b[key] / a[key]) / math.log(b["groups"] / a["groups"])
    n_max = b["groups"] * (1.0 / b[key]) ** (1 / exp)
    return (
        f"{key}: grows as groups^{exp:.2f} between {a['groups']} and {b['groups']}; "
        f"1 core near {n_max:,.0f} groups (extrapolated)"
    )


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Plots CPU per simulated second and quorum latency by fleet size (PNG), with matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = [r["groups"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.loglog(sizes, [r["cpu_core"] for r in rows], "o-")
    left.axhline(1.0, color="red", linestyle="--", label="one core")
    left.set_xlabel("replica groups")
    left.set_ylabel("lighthouse CPU s per simulated s")
    left.legend()
    for key in ("lat_ms_p50", "lat_ms_p99"):
        right.loglog(sizes, [max(r[key], 1e-3) for r in rows], "o-", label=key)
    right.set_xlabel("replica groups")
    right.set_ylabel("quorum latency (ms)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--sizes", default="1000,3000,10000,30000,100000")
    parser.add_argument("--seconds", type=float, default=60.0, help="simulated seconds per run")
    parser.add_argument(
        "--seconds-large",
        type=float,
        default=15.0,
        help="simulated seconds for sizes over 3000 (default 15)",
    )
    parser.add_argument("--warmup", type=float, default=5.0, help="simulated seconds not measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-s", type=float, default=1.0, help="training step (default 1 s)")
    parser.add_argument("--restart-s", type=float, default=60.0)
    parser.add_argument("--spares", type=float, default=0.02, help="spares per group (0.02)")
    parser.add_argument("--mtbf-h", type=float, default=24.0, help="per group (default 24 h)")
    parser.add_argument("--dist", choices=("exp", "weibull"), default="weibull")
    parser.add_argument("--weibull-k", type=float, default=0.7)
    parser.add_argument("--rack-size", type=int, default=32)
    parser.add_argument("--rack-mtbf-h", type=float, default=30 * 24.0)
    parser.add_argument(
        "--goodput-max", type=int, default=10000, help="largest size with goodput runs"
    )
    parser.add_argument(
        "--rpc-us", type=float, default=RPC_US, help="transport CPU per RPC for est_core"
    )
    parser.add_argument("--json", help="also write every row to this JSON file")
    parser.add_argument("--png", help="also plot CPU and latency by size (needs matplotlib)")
    parser.add_argument("--quick", action="store_true", help="a run of under 20 s")
    add_common_args(parser)  # --smoke is --quick
    args = parser.parse_args(argv)
    if args.quick or args.smoke:
        args.sizes, args.seconds, args.seconds_large, args.warmup = "300,1000", 8.0, 8.0, 2.0
        args.goodput_max, args.mtbf_h = 1000, min(args.mtbf_h, 1.0)
    sizes = [int(s) for s in args.sizes.split(",")]
    model = FailureModel(
        group_mtbf_s=args.mtbf_h * 3600,
        dist=args.dist,
        weibull_k=args.weibull_k,
        rack_size=args.rack_size,
        rack_mtbf_s=args.rack_mtbf_h * 3600,
    )
    print(f"failure model: {model}")
    started = time.perf_counter()
    cost_rows: list[dict[str, Any]] = []
    goodput_rows: list[dict[str, Any]] = []
    for n in sizes:
        seconds = args.seconds if n <= 3000 else args.seconds_large
        base = FleetConfig(
            n_groups=n,
            seconds=seconds,
            seed=args.seed,
            step_s=args.step_s,
            warmup_s=args.warmup,
            restart_s=args.restart_s,
            failures=model,
        )
        t0 = time.perf_counter()
        spared = Fleet(replace(base, spares=max(1, round(args.spares * n)))).run()
        memory = state_memory_bytes(n)
        cost_rows.append(cost_row(n, spared, memory, args.rpc_us))
        if n <= args.goodput_max:
            free = Fleet(replace(base, failures=FAULT_FREE)).run()
            bare = Fleet(base).run()
            goodput_rows.append(goodput_row(n, free, bare, spared))
        print(f"  {n} groups: {time.perf_counter() - t0:.1f} s of real time", flush=True)
    print("\ncosts (failures and spares; *_us real time per membership call):")
    report(cost_rows, results_file(args.out, "fleet_sim"))
    if goodput_rows:
        print("\ngoodput (group-steps trained / fault-free fleet's, same window):")
        report(goodput_rows, results_file(args.out, "fleet_sim_goodput"))
    print("\n" + keeping_up(cost_rows) + "\n" + keeping_up(cost_rows, "est_core"))
    print(f"run time {time.perf_counter() - started:.1f} s")
    if args.json:
        out = {
            "args": vars(args),
            "model": asdict(model),
            "costs": cost_rows,
            "goodput": goodput_rows,
            "keeping_up": [keeping_up(cost_rows), keeping_up(cost_rows, "est_core")],
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.png:
        print(f"plot: {args.png}" if plot(cost_rows, Path(args.png)) else "no matplotlib: no plot")


if __name__ == "__main__":
    main()
