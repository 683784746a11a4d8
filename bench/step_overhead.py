"""Step time of torchft_like DDP versus plain torch DDP, interleaved.

    python -m bench.step_overhead [--hidden 1024 2500] [--repeats 3]

For each model size, runs A B A B ...: A = plain torch DDP over 2 gloo ranks
(one torchrun with 2 processes); B = 2 replica groups of one rank each (a
lighthouse and two torchruns). Every process has OMP_NUM_THREADS=1; all on
127.0.0.1. Reports the median step time of each, min/max over runs, and the
per-pair ratio B/A. An MLP of 4 layers of width 1024 has 4.2M parameters,
width 2500 has 25M.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._report import report

REPO = Path(__file__).resolve().parent.parent
WORKER = str(REPO / "bench" / "_step_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(
    nproc: int, port: int, worker_args: list[str], env: dict[str, str]
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
         str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(port), WORKER,
         *worker_args],
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
    )  # fmt: skip


def run_plain(hidden: int, steps: int, tmp: Path) -> float:
    out = tmp / "plain.json"
    proc = torchrun(2, free_port(), ["--mode", "plain", "--hidden", str(hidden),
                                     "--steps", str(steps), "--out", str(out)], {})  # fmt: skip
    if proc.wait(600) != 0:
        raise RuntimeError("plain DDP run failed")
    return statistics.median(json.loads(out.read_text())["times"])


def run_ft(hidden: int, steps: int, tmp: Path) -> float:
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "lighthouse", "--min-replicas", "2", "--bind", "127.0.0.1:0",
         "--http-bind", ""],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        address = next(
            line.split("listening on ")[1].split()[0]
            for line in lighthouse.stdout
            if "listening on" in line
        )
        groups = [
            torchrun(1, free_port(), ["--mode", "ft", "--hidden", str(hidden), "--steps",
                                      str(steps), "--out", str(tmp / f"ft{g}.json")],
                     {"TORCHFT_LIGHTHOUSE": address, "REPLICA_GROUP_ID": str(g)})
            for g in range(2)
        ]  # fmt: skip
        if any(g.wait(600) != 0 for g in groups):
            raise RuntimeError("torchft_like run failed")
    finally:
        lighthouse.kill()
        lighthouse.wait()
    return statistics.median(json.loads((tmp / "ft0.json").read_text())["times"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 2500])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", default="bench_results/step_overhead.jsonl")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for hidden in args.hidden:
            plain, ft = [], []
            for _ in range(args.repeats):
                plain.append(run_plain(hidden, args.steps, Path(tmp)))
                ft.append(run_ft(hidden, args.steps, Path(tmp)))
            ratios = [b / a for a, b in zip(plain, ft)]
            params = 4 * (hidden * hidden + hidden)
            rows.append(
                {
                    "params_m": round(params / 1e6, 1),
                    "plain_ms": round(1000 * statistics.median(plain), 2),
                    "ft_ms": round(1000 * statistics.median(ft), 2),
                    "ratio": round(statistics.median(ratios), 3),
                    "ratio_min": round(min(ratios), 3),
                    "ratio_max": round(max(ratios), 3),
                }
            )
    report(rows, args.results)


if __name__ == "__main__":
    main()
