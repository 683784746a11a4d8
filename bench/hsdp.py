"""FT-HSDP versus plain torch HSDP: step time in the same run, and heal time and
bytes per shard.

    python -m bench.hsdp [--hidden 1024] [--repeats 2] [--steps 30] [--out DIR] [--smoke]

Runs A B C A B C ...: A = plain torch HSDP, fully_shard over a 2-D mesh
(2 replicate x 2 shard) of 4 gloo ranks in one world; B = FT-HSDP, 2 replica
groups of 2 ranks (each its own world sharding the model, the replicate
dimension through the Manager; our lighthouse) healing over HTTP; C = the
same healing over PGTransport. The model is 4 square Linear layers of width
--hidden, each fully_shard-ed, batch 32 per rank, AdamW; --warmup steps,
then --steps measured (rank 0's step time, median per run; cpu_ms: rank 0's
process CPU time per measured step, all threads, which other load inflates
far less than wall time). In B and C, once
the two groups have measured their steps, a third group of 2 ranks starts,
and each of its ranks heals its shard from rank r of a live group: its
heal_s is the Manager's receive time (the slower rank's), shard_mb the bytes
of one rank's model and optimizer state, heal_mb what moved to the group
(both ranks' shards), full_state_mb the whole model's. HTTP and PG heal
figures come side by side: *_heal_s and *_heal_mb per transport.
Every process has OMP_NUM_THREADS=1; all on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._report import REPO, add_common_args, report, results_file
from bench.step_overhead import start_lighthouse
from tools.procs import free_port, kill_tree

WORKER = str(REPO / "bench" / "_hsdp_worker.py")


def spawn_world(size: int, worker_args: list[str], env: dict[str, str], log: Path) -> list:
    """`size` ranks of one gloo world (no torchrun: the driver sets its variables)."""
    port = free_port()
    pythonpath = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH")] if p)
    procs = []
    for rank in range(size):
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath,
                    "RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), **env}  # fmt: skip
        with open(f"{log}.{rank}", "wb") as out:
            args = [a.replace("{rank}", str(rank)) for a in worker_args]
            proc = subprocess.Popen([sys.executable, WORKER, *args], env=full_env, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=REPO)  # fmt: skip
        proc.log = Path(f"{log}.{rank}")  # type: ignore[attr-defined]
        procs.append(proc)
    return procs


def read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def wait_for(condition, procs: list, what: str, timeout_s: float) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            tail = failed[0].log.read_text(errors="replace")[-3000:] if failed else ""
            raise RuntimeError(f"{what}: {'a rank failed' if failed else 'timed out'}\n{tail}")
        time.sleep(0.1)


def run_once(mode: str, worker_args: list[str], tmp: Path, timeout_s: float) -> dict:
    """One run of one contender: rank 0's step times, and for FT the heal."""
    for old in tmp.glob("*.json"):
        old.unlink()
    if mode == "plain":
        procs = spawn_world(4, ["--mode", "plain", "--out", str(tmp / "plain{rank}.json"),
                                *worker_args], {}, tmp / "plain.log")  # fmt: skip
        try:
            wait_for(lambda: all(p.poll() == 0 for p in procs), procs, "plain HSDP", timeout_s)
        finally:
            for p in procs:
                kill_tree(p.pid)
                p.wait()
        return read(tmp / "plain0.json")
    transport = mode.removeprefix("ft_")
    stop = tmp / "stop"
    stop.unlink(missing_ok=True)
    lighthouse, address = start_lighthouse("ft")
    procs: list = []

    def group(g: int) -> list:
        return spawn_world(
            2,
            ["--mode", "ft", "--transport", transport, "--group", str(g), "--stop-file",
             str(stop), "--out", str(tmp / f"ft{g}_{{rank}}.json"), *worker_args],
            {"TORCHFT_LIGHTHOUSE": address},
            tmp / f"ft{g}.log",
        )  # fmt: skip

    try:
        procs += group(0) + group(1)
        wait_for(lambda: "times" in read(tmp / "ft0_0.json"), procs, f"{mode} steps", timeout_s)
        procs += group(2)  # a new group: each rank heals its shard from a live group
        healed = [tmp / f"ft2_{r}.json" for r in range(2)]
        wait_for(lambda: all("heal_s" in read(f) for f in healed), procs, "heal", timeout_s)
        # Every group ends at one step a little ahead, all in one quorum: a
        # group that stopped at once would leave the others' collectives
        # (and its own group's FSDP ones) waiting for it.
        stop.write_text(str(max(read(f)["heal_step"] for f in healed) + 10))
        wait_for(lambda: all(p.poll() is not None for p in procs), procs, "stop", 60)
    finally:
        for p in procs:
            kill_tree(p.pid)
            p.wait()
        lighthouse.kill()
        lighthouse.wait()
    out = read(tmp / "ft0_0.json")
    heals = [read(f) for f in healed]
    out["heal_s"] = max(h["heal_s"] for h in heals)
    out["shard_bytes"] = [h["shard_bytes"] for h in heals]
    out["full_state_bytes"] = heals[0]["full_state_bytes"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.steps, args.warmup, args.repeats = 64, 3, 1, 1
    # The smoke run proves the driver and both worker kinds run; the HTTP
    # heal it would add is tested in tests/e2e/test_hsdp.py.
    contenders = ["plain", "ft_pg"] if args.smoke else ["plain", "ft_http", "ft_pg"]
    worker_args = ["--hidden", str(args.hidden), "--steps", str(args.steps),
                   "--warmup", str(args.warmup)]  # fmt: skip
    timeout_s = 120 + args.steps * args.hidden * args.hidden / 1e6
    runs: dict[str, list[dict]] = {m: [] for m in contenders}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for mode in contenders:
                runs[mode].append(run_once(mode, worker_args, Path(tmp), timeout_s))
    medians = {m: [r["median_s"] for r in rs] for m, rs in runs.items()}
    row: dict = {"params_m": round(4 * (args.hidden**2 + args.hidden) / 1e6, 2)}
    for m, ms in medians.items():
        row[f"{m}_ms"] = round(1000 * statistics.median(ms), 1)
        row[f"{m}_cpu_ms"] = round(1000 * statistics.median(r["cpu_per_step"] for r in runs[m]), 1)
    for m in contenders[1:]:
        ratios = [b / a for a, b in zip(medians["plain"], medians[m])]
        row[f"{m}_ratio"] = round(statistics.median(ratios), 3)
        row[f"{m}_ratio_min_max"] = f"{min(ratios):.3f}-{max(ratios):.3f}"
        row[f"{m}_heal_s"] = round(statistics.median(r["heal_s"] for r in runs[m]), 3)
        row[f"{m}_heal_mb"] = round(sum(runs[m][0]["shard_bytes"]) / 1e6, 2)
    row["shard_mb"] = round(runs["ft_pg"][0]["shard_bytes"][0] / 1e6, 2)
    row["full_state_mb"] = round(runs["ft_pg"][0]["full_state_bytes"] / 1e6, 2)
    report([row], results_file(args.out, "hsdp"))


if __name__ == "__main__":
    main()
