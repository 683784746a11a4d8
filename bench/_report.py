"""Shared by the benchmarks: common flags, print rows as a table, append them as JSON lines."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """--out (results directory) and --smoke (a tiny run for CI, no targets)."""
    parser.add_argument(
        "--out",
        default="bench_results",
        help="directory for the JSON lines results, relative to the repo or absolute "
        "(default bench_results)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny configuration that runs in seconds (CI)"
    )


def pct(xs: list[float], q: float) -> float:
    """The `q` quantile of `xs` (nearest rank below); nan for none."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def results_file(out: str, name: str) -> str:
    """The JSON lines file of benchmark `name` under results directory `out`."""
    return str(Path(out) / f"{name}.jsonl")


def report(rows: list[dict[str, Any]], results: str) -> None:
    """Prints `rows` (same keys each) as a table; appends them to `results`,
    a path relative to the repository (or absolute), one JSON object a line."""
    keys = list(max(rows, key=len))  # a row for a run that failed has fewer
    widths = [max(len(k), *(len(str(r.get(k))) for r in rows)) for k in keys]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(str(r.get(k)).rjust(w) for k, w in zip(keys, widths)))
    out = REPO / results
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps({"time": time.time(), **r}) + "\n")
    print(f"appended to {out}")
