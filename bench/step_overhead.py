"""Step time of torchft_like DDP versus plain torch DDP (and pytorch/torchft), interleaved.

    python -m bench.step_overhead [--hidden 1000 2500] [--repeats 3] [--out DIR] [--smoke]

For each model size, runs A B C A B C ...: A = plain torch DDP over 2 gloo
ranks (one torchrun with 2 processes); B = torchft_like, 2 replica groups of
one rank each (our lighthouse and two torchruns); C = pytorch/torchft the
same way (its Rust lighthouse), only when `import torchft` works (the `bench`
extra): a reference, the library never imports it. Every process has
OMP_NUM_THREADS=1; all on 127.0.0.1. The model is an MLP of 4 square layers,
batch 32, AdamW (width 1000: 4.0M fp32 parameters, 2500: 25M); 10 warm-up
steps, then --steps measured. Reports per contender the median step time,
min/max over runs of the per-run median, the CPU time per step of rank 0's
process (all threads; robust to other load), the per-pair ratio to A, and the
RPCs the step sends on its critical path (heartbeats left out).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._report import REPO, add_common_args, report, results_file
from tools.procs import free_port, kill_tree

WORKER = str(REPO / "bench" / "_step_worker.py")
TORCHFT_LIGHTHOUSE_RPCS = 1
"""torchft's Rust ManagerServer asks its lighthouse once per step for the
group; that call is out of Python's reach, so it is added, not counted."""


def wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lighthouse exited with {proc.returncode} before listening")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"lighthouse not listening on port {port} after {timeout_s} s")


def torchrun(
    nproc: int, worker_args: list[str], env: dict[str, str], log: Path
) -> subprocess.Popen:
    """Starts one torchrun of `nproc` workers, its output in `log`."""
    pythonpath = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH")] if p)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
             str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(free_port()), WORKER,
             *worker_args],
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath, **env},
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
    proc.log = log  # type: ignore[attr-defined]
    return proc


def wait_all(procs: list[subprocess.Popen], what: str, timeout_s: float) -> None:
    """Waits for every torchrun; on a failure or the deadline, kills every
    tree (torchrun's workers too) and raises with the failing log's tail."""
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            try:
                rc = p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                rc = None
            if rc != 0:
                tail = p.log.read_text(errors="replace")[-3000:]  # type: ignore[attr-defined]
                why = f"exited with {rc}" if rc is not None else f"ran past {timeout_s:.0f} s"
                raise RuntimeError(f"{what} failed: a torchrun {why}; its log ends:\n{tail}")
    finally:
        for p in procs:
            kill_tree(p.pid)
            p.wait()


def start_lighthouse(mode: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if mode == "ft":
        cmd = [sys.executable, "-m", "lighthouse", "--min-replicas", "2", "--http-bind", ""]
    else:
        exe = shutil.which("torchft_lighthouse") or str(
            Path(sys.executable).parent / "torchft_lighthouse"
        )
        cmd = [exe, "--min_replicas", "2"]
    proc = subprocess.Popen(
        [*cmd, "--bind", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
    )  # fmt: skip
    try:
        wait_port(port, proc)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, f"http://127.0.0.1:{port}"


def run_once(mode: str, worker_args: list[str], tmp: Path, timeout_s: float) -> dict:
    """One run of one contender; returns rank 0's JSON (times, RPC counts)."""
    out = tmp / f"{mode}.json"
    out.unlink(missing_ok=True)
    if mode == "plain":
        proc = torchrun(2, ["--mode", "plain", "--out", str(out), *worker_args], {},
                        tmp / "plain.log")  # fmt: skip
        wait_all([proc], "plain DDP", timeout_s)
        return json.loads(out.read_text())
    lighthouse, address = start_lighthouse(mode)
    try:
        groups = [
            torchrun(1, ["--mode", mode, "--out", str(tmp / f"{mode}{g}.json"), *worker_args],
                     {"TORCHFT_LIGHTHOUSE": address, "REPLICA_GROUP_ID": str(g)},
                     tmp / f"{mode}{g}.log")
            for g in range(2)
        ]  # fmt: skip
        wait_all(groups, mode, timeout_s)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    return json.loads((tmp / f"{mode}0.json").read_text())


def summarize(hidden: int, runs: dict[str, list[dict]]) -> dict:
    """One row: per contender the median, min and max of per-run medians in ms,
    and the per-pair ratios to plain (same repeat)."""
    medians = {m: [statistics.median(r["times"]) for r in rs] for m, rs in runs.items()}
    row: dict = {"params_m": round(4 * (hidden * hidden + hidden) / 1e6, 1)}
    for m, ms in medians.items():
        row[f"{m}_ms"] = round(1000 * statistics.median(ms), 1)
        row[f"{m}_min_max"] = f"{1000 * min(ms):.0f}-{1000 * max(ms):.0f}"
    for m, rs in runs.items():
        row[f"{m}_cpu_ms"] = round(1000 * statistics.median(r["cpu_per_step"] for r in rs), 1)
    for m in medians:
        if m == "plain":
            continue
        ratios = [b / a for a, b in zip(medians["plain"], medians[m])]
        row[f"{m}_ratio"] = round(statistics.median(ratios), 3)
        row[f"{m}_ratio_min_max"] = f"{min(ratios):.3f}-{max(ratios):.3f}"
        rpcs = statistics.median(r["rpcs_per_step"] for r in runs[m])
        row[f"{m}_rpcs"] = round(rpcs + (TORCHFT_LIGHTHOUSE_RPCS if m == "torchft" else 0), 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[1000, 2500])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--contenders", nargs="+", default=["plain", "ft", "torchft"],
        help="plain, ft and torchft (skipped when torchft is not installed)",
    )  # fmt: skip
    parser.add_argument("--profile", default="", help="directory for torch.profiler tables")
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.steps, args.warmup, args.repeats = [64], 5, 2, 1
        args.contenders = ["plain", "ft"]
    have_torchft = importlib.util.find_spec("torchft") is not None
    contenders = [m for m in args.contenders if m != "torchft" or have_torchft]
    if "plain" not in contenders:
        raise ValueError(f"--contenders {args.contenders} must include plain: ratios are to it")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for hidden in args.hidden:
            worker_args = ["--hidden", str(hidden), "--steps", str(args.steps),
                           "--warmup", str(args.warmup), "--profile", args.profile]  # fmt: skip
            timeout_s = 60 + args.steps * hidden * hidden / 1e6 * 2
            runs: dict[str, list[dict]] = {m: [] for m in contenders}
            for _ in range(args.repeats):
                for mode in contenders:
                    runs[mode].append(run_once(mode, worker_args, Path(tmp), timeout_s))
            rows.append(summarize(hidden, runs))
    report(rows, results_file(args.out, "step_overhead"))


if __name__ == "__main__":
    main()
