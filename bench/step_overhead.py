"""Step time of torchft_like DDP versus plain torch DDP (and pytorch/torchft), interleaved.

    python -m bench.step_overhead [--hidden 1000 2500] [--allocator default keep]
        [--rounds 12] [--steps 20] [--launches 1] [--pin] [--out DIR] [--smoke]
        [--device cpu|cuda] [--process-group gloo|nccl]

On CUDA (--device cuda) the model and data are on the GPU, both contenders
use gloo (torch's for plain DDP, ours across the groups) unless
--process-group nccl, and a step's time ends when the GPU is done with it.

Contenders: plain = torch DDP over 2 gloo ranks (one torchrun with 2
processes); ft = torchft_like, 2 replica groups of one rank each (our
lighthouse and two torchruns); torchft = pytorch/torchft the same way (its
Rust lighthouse), only when `import torchft` works (the `bench` extra): a
reference, the library never imports it. Each runs under each --allocator:
default (glibc as it comes) and keep (GLIBC_TUNABLES with a 32 MB mmap
threshold and a 16 GB trim threshold: freed memory stays in the heap, a
common production setting), set in every worker's environment. Every
process has OMP_NUM_THREADS=1; all on 127.0.0.1. The model is an MLP of 4
square layers, batch 32, AdamW (width 1000: 4.0M fp32 parameters, 2500: 25M).

Precision. All contenders of one size are started once and stay alive; the
driver then has them take turns: a round gives each contender one block of
--steps steps, one after another, the order reversed every other round (A B
C, C B A, ...), so slow drifts in the machine's load fall on all alike.
The first step of each block is not counted (caches cold after the wait).
Per step, rank 0 reports wall time, its process's CPU time (all threads:
less sensitive to other load than wall time), minor page faults, and the
wall of the step's phases (zero_grad, forward, backward, optimizer: where
a gap is).

Statistics. Per contender: the median over all counted steps (wall, CPU),
mean minor faults per step, and CPU drift: the median CPU per step of the
last fifth of its counted steps over that of the first fifth, minus 1; and
the same of its per-round CPU ratios to plain (`_drift_cpu_vs_plain`), its
own drift without the machine's, with a 95% bootstrap interval.
Ratio to plain under the same allocator: per round, the ratio of the two
blocks' medians; the figure is the geometric mean of those per-round
ratios, and its 95% interval a percentile bootstrap over rounds (2000
resamples of the rounds with replacement, random.Random(0)). With
--launches N every contender is started afresh N times, the rounds split
among the launches: under glibc's default allocator a process's page
faults, and so its CPU, depend on its allocation history, which one launch
draws once. The interval then resamples launches, then rounds within
them, and each launch's own ratio and faults per step are listed
(`_by_launch`). Wall and CPU ratios both; with --ft-baseline, ft's to ftbase's the same way
(`ft_vs_ftbase`: a change's effect, paired round by round). Also the RPCs the step sends on
its critical path (heartbeats left out), and its CPU per step by thread
(training, our quorum thread and server loop, grpc's, gloo's: where the
difference to plain is spent). Each round's block medians, in run order,
go to step_overhead_rounds.jsonl beside the summary (the shape of a drift).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._report import REPO, add_common_args, report, results_file
from tools.procs import free_port, kill_tree, wait_listening

WORKER = str(REPO / "bench" / "_step_worker.py")
TORCHFT_LIGHTHOUSE_RPCS = 1
"""torchft's Rust ManagerServer asks its lighthouse once per step for the
group; that call is out of Python's reach, so it is added, not counted."""
ALLOCATORS = {
    "default": {},
    "keep": {
        "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432"
        ":glibc.malloc.trim_threshold=17179869184"
    },
}
"""Environment of every worker per --allocator: keep = glibc never returns
freed memory to the system and serves blocks under 32 MB from its heap."""
BOOTSTRAP_RESAMPLES = 2000


def torchrun(
    nproc: int, worker_args: list[str], env: dict[str, str], log: Path
) -> subprocess.Popen:
    """Starts one torchrun of `nproc` workers, its output in `log`."""
    first = env.pop("CODE", str(REPO))
    pythonpath = os.pathsep.join(p for p in [first, os.environ.get("PYTHONPATH")] if p)
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


LIGHTHOUSE_CODE = [str(REPO)]
"""Where `python -m lighthouse` runs from (--lighthouse-code)."""


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
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=LIGHTHOUSE_CODE[0],
    )  # fmt: skip
    try:
        wait_listening(port, proc, "lighthouse")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, f"http://127.0.0.1:{port}"


class Contender:
    """One contender (mode, allocator) of one size: its processes, started
    at once, and the control connections of its ranks once they call in."""

    def __init__(
        self, label: str, allocator: str, worker_args: list[str], tmp: Path, code: str = ""
    ) -> None:
        mode = "ft" if label == "ftbase" else label
        self.mode, self.allocator = mode, allocator
        self.name = f"{label}/{allocator}"
        self.procs: list[subprocess.Popen] = []
        self.ranks: dict[tuple[str, int], tuple[socket.socket, object]] = {}
        """(replica group, rank) -> control connection."""
        env = {**ALLOCATORS[allocator], **({"CODE": code} if code else {})}
        stem = f"{label}_{allocator}"
        args = ["--mode", mode, "--name", self.name, *worker_args]
        if mode == "plain":
            self.procs.append(torchrun(2, args, env, tmp / f"{stem}.log"))
            return
        lighthouse, address = start_lighthouse(mode)
        self.procs.append(lighthouse)
        for g in range(2):
            group_env = {**env, "TORCHFT_LIGHTHOUSE": address, "REPLICA_GROUP_ID": str(g)}
            self.procs.append(torchrun(1, args, group_env, tmp / f"{stem}{g}.log"))

    def check_alive(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                log = getattr(p, "log", None)
                tail = log.read_text(errors="replace")[-3000:] if log else "(lighthouse)"
                raise RuntimeError(f"{self.name}: a process exited with {p.returncode}:\n{tail}")

    def command(self, cmd: dict, timeout_s: float) -> dict:
        """Sends `cmd` to every rank; returns the answer of rank 0 (of group 0)
        once all answered."""
        line = json.dumps(cmd) + "\n"
        for _, stream in self.ranks.values():
            stream.write(line)  # type: ignore[attr-defined]
            stream.flush()  # type: ignore[attr-defined]
        replies = {}
        for rank, (sock, stream) in self.ranks.items():
            sock.settimeout(timeout_s)
            try:
                reply = stream.readline()  # type: ignore[attr-defined]
            except TimeoutError:
                reply = ""
            if not reply:
                self.check_alive()
                raise RuntimeError(f"{self.name} rank {rank}: no answer to {cmd} in {timeout_s} s")
            replies[rank] = json.loads(reply)
        return replies[("0", 0)]

    def stop(self) -> None:
        for sock, stream in self.ranks.values():
            try:
                stream.write(json.dumps({"cmd": "stop"}) + "\n")  # type: ignore[attr-defined]
                stream.flush()  # type: ignore[attr-defined]
            except OSError:
                pass
            sock.close()
        for p in self.procs:
            kill_tree(p.pid)
            p.wait()


def connect_all(server: socket.socket, contenders: list[Contender], timeout_s: float) -> None:
    """Accepts every rank's call-in (2 per contender)."""
    by_name = {c.name: c for c in contenders}
    deadline = time.monotonic() + timeout_s
    while any(len(c.ranks) < 2 for c in contenders):
        server.settimeout(1.0)
        try:
            sock, _ = server.accept()
        except TimeoutError:
            for c in contenders:
                c.check_alive()
            if time.monotonic() > deadline:
                late = [c.name for c in contenders if len(c.ranks) < 2]
                raise RuntimeError(f"{late} did not start within {timeout_s:.0f} s") from None
            continue
        sock.settimeout(timeout_s)
        stream = sock.makefile("rw")
        hello = json.loads(stream.readline())
        by_name[hello["name"]].ranks[(hello["group"], hello["rank"])] = (sock, stream)


def geo_mean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def ratio_interval(ratios: list[float], launches: list[int] | None = None) -> tuple[float, float]:
    """95% percentile bootstrap over rounds of the geometric mean ratio.

    With `launches` (each round's launch), two stages: launches resampled,
    then rounds within each. Rounds of one launch share its processes'
    allocator history, which moves the ratio more than rounds scatter
    (bench/NOTES.md, "Seventh pass"): resampling rounds alone would give a
    narrower interval than the next launch bears out."""
    rng = random.Random(0)
    if launches is None:
        clusters = [ratios]
    else:
        by_launch: dict[int, list[float]] = {}
        for launch, ratio in zip(launches, ratios):
            by_launch.setdefault(launch, []).append(ratio)
        clusters = list(by_launch.values())

    def resample() -> list[float]:
        picked = clusters if launches is None else rng.choices(clusters, k=len(clusters))
        return [r for c in picked for r in rng.choices(c, k=len(c))]

    means = sorted(geo_mean(resample()) for _ in range(BOOTSTRAP_RESAMPLES))
    return means[int(0.025 * len(means))], means[int(0.975 * len(means)) - 1]


def cpu_drift(cpu: list[float]) -> float:
    """Median CPU per step of the last fifth of the counted steps (in run
    order) over that of the first fifth, minus 1: a heap or cache that grows
    through the run shows here, not in the medians."""
    fifth = max(1, len(cpu) // 5)
    return statistics.median(cpu[-fifth:]) / statistics.median(cpu[:fifth]) - 1


def drift_vs_plain(ours: list[float], plain: list[float]) -> float:
    """cpu_drift of the per-round ratios to plain (block medians, in run
    order): a contender's own drift. The machine's drift moves plain's
    interleaved blocks alike and cancels here, not in cpu_drift."""
    return cpu_drift([o / p for o, p in zip(ours, plain)])


def drift_interval(series: list[float]) -> tuple[float, float]:
    """95% percentile bootstrap of cpu_drift(series): the first and the last
    fifth resampled apart. Per-round ratios scatter ~10% on this machine, so
    a fifth's median of 40 rounds moves ~2%, and a drift of a few percent
    can be noise: this says how much."""
    fifth = max(1, len(series) // 5)
    first, last = series[:fifth], series[-fifth:]
    rng = random.Random(0)
    drifts = sorted(
        statistics.median(rng.choices(last, k=fifth))
        / statistics.median(rng.choices(first, k=fifth))
        - 1
        for _ in range(BOOTSTRAP_RESAMPLES)
    )
    return drifts[int(0.025 * len(drifts))], drifts[int(0.975 * len(drifts)) - 1]


def round_rows(hidden: int, allocator: str, blocks: dict[str, list[dict]]) -> list[dict]:
    """Per round, in run order, each contender's block medians (ms): where a
    drift begins and whether it is steady or a jump (the summary's cpu_drift
    compares only the first and last fifths)."""
    rows = []
    for r in range(min(len(bs) for bs in blocks.values())):
        row: dict = {"hidden": hidden, "allocator": allocator, "round": r}
        for mode, bs in blocks.items():
            row[f"{mode}_ms"] = round(1000 * statistics.median(bs[r]["times"]), 2)
            row[f"{mode}_cpu_ms"] = round(1000 * statistics.median(bs[r]["cpu"]), 2)
        rows.append(row)
    return rows


def summarize(hidden: int, allocator: str, blocks: dict[str, list[dict]]) -> dict:
    """One row per (size, allocator): per contender the median step in ms
    (wall, CPU) over all counted steps, faults per step, and the ratios to
    plain (geometric mean of per-round ratios, bootstrap interval)."""
    row: dict = {"params_m": round(4 * (hidden * hidden + hidden) / 1e6, 1), "allocator": allocator}
    per_round: dict[str, dict[str, list[float]]] = {}
    launches = [b.get("launch", 0) for b in blocks["plain"]]
    several = len(set(launches)) > 1
    for mode, bs in blocks.items():
        wall = [t for b in bs for t in b["times"]]
        cpu = [t for b in bs for t in b["cpu"]]
        row[f"{mode}_ms"] = round(1000 * statistics.median(wall), 1)
        row[f"{mode}_cpu_ms"] = round(1000 * statistics.median(cpu), 1)
        row[f"{mode}_minflt"] = round(statistics.fmean(f for b in bs for f in b["minflt"]), 1)
        if several:
            row[f"{mode}_minflt_by_launch"] = " ".join(
                f"{statistics.fmean(f for b in bs if b['launch'] == n for f in b['minflt']):.0f}"
                for n in sorted(set(launches))
            )
        row[f"{mode}_drift_cpu"] = round(cpu_drift(cpu), 3)
        phases = [s for b in bs for s in b.get("phases", [])]  # an older ftbase has none
        if phases:
            row[f"{mode}_zero_fwd_bwd_opt_ms"] = "/".join(
                f"{1000 * statistics.median(s[i] for s in phases):.1f}" for i in range(4)
            )
        threads = [b["thread_cpu_ms"] for b in bs if "thread_cpu_ms" in b]
        if threads:  # CPU per step by thread, median over blocks, the busiest first
            names = {n for t in threads for n in t}
            per = {n: statistics.median(t.get(n, 0.0) for t in threads) for n in names}
            row[f"{mode}_thread_cpu_ms"] = ", ".join(
                f"{n} {ms:.2f}"
                for n, ms in sorted(per.items(), key=lambda kv: -kv[1])
                if ms >= 0.05
            )
        per_round[mode] = {
            "wall": [statistics.median(b["times"]) for b in bs],
            "cpu": [statistics.median(b["cpu"]) for b in bs],
        }
    for mode in blocks:
        if mode == "plain":
            continue
        for kind in ("wall", "cpu"):
            ratios = [o / p for p, o in zip(per_round["plain"][kind], per_round[mode][kind])]
            low, high = ratio_interval(ratios, launches if several else None)
            suffix = "" if kind == "wall" else "_cpu"
            row[f"{mode}_ratio{suffix}"] = round(geo_mean(ratios), 3)
            row[f"{mode}_ci95{suffix}"] = f"{low:.3f}-{high:.3f}"
            if several:  # each launch's own ratio: how much its allocator history moved it
                row[f"{mode}_ratio{suffix}_by_launch"] = " ".join(
                    f"{geo_mean([r for r, n in zip(ratios, launches) if n == launch]):.3f}"
                    for launch in sorted(set(launches))
                )
        ours, plain = per_round[mode]["cpu"], per_round["plain"]["cpu"]
        row[f"{mode}_drift_cpu_vs_plain"] = round(drift_vs_plain(ours, plain), 3)
        low, high = drift_interval([o / p for o, p in zip(ours, plain)])
        row[f"{mode}_drift_cpu_vs_plain_ci95"] = f"{low:.3f}-{high:.3f}"
        rpcs = statistics.median(b["rpcs_per_step"] for b in blocks[mode])
        row[f"{mode}_rpcs"] = round(rpcs + (TORCHFT_LIGHTHOUSE_RPCS if mode == "torchft" else 0), 2)
    if "ft" in per_round and "ftbase" in per_round:  # a change's before/after, round by round
        for kind in ("wall", "cpu"):
            ratios = [n / o for o, n in zip(per_round["ftbase"][kind], per_round["ft"][kind])]
            low, high = ratio_interval(ratios)
            suffix = "" if kind == "wall" else "_cpu"
            row[f"ft_vs_ftbase{suffix}"] = round(geo_mean(ratios), 3)
            row[f"ft_vs_ftbase_ci95{suffix}"] = f"{low:.3f}-{high:.3f}"
    return row


def run_launch(launch: int, rounds: range, names: list[tuple[str, str]], args: argparse.Namespace,
               worker_args: list[str], tmp: Path, server: socket.socket, step_s: float,
               blocks: dict[str, list[dict]]) -> None:  # fmt: skip
    """Starts every contender (mode, allocator) afresh, warms each up, runs
    `rounds` of the interleaving and adds each block, tagged with `launch`,
    to `blocks`; stops them all on the way out."""
    block_timeout = 60 + 4 * args.steps * step_s
    contenders: list[Contender] = []
    try:
        for mode, allocator in names:
            code = args.ft_baseline if mode == "ftbase" else ""
            contenders.append(Contender(mode, allocator, worker_args, tmp, code))
        connect_all(server, contenders, timeout_s=240)
        for c in contenders:
            c.command({"cmd": "run", "steps": args.warmup}, 60 + 4 * args.warmup * step_s + 60)
        for r in rounds:
            for c in contenders if r % 2 == 0 else contenders[::-1]:
                b = c.command({"cmd": "run", "steps": args.steps + 1}, block_timeout)
                counted = {k: v[1:] if isinstance(v, list) else v for k, v in b.items()}
                blocks[c.name].append({"launch": launch, **counted})
        if args.profile and launch == args.launches - 1:
            for c in contenders:
                c.command({"cmd": "profile", "dir": args.profile}, block_timeout)
    finally:
        for c in contenders:
            c.stop()


def measure(hidden: int, modes: list[str], allocators: list[str], args: argparse.Namespace,
            tmp: Path) -> tuple[list[dict], list[dict]]:  # fmt: skip
    """Runs the interleaved rounds of one size over --launches launches of
    every contender; returns one summary row per allocator, and the
    per-round rows (round_rows)."""
    step_s = 0.05 + 4 * hidden * hidden / 1e6 * 0.02  # generous: a loaded 2-core machine
    server = socket.create_server(("127.0.0.1", 0))
    control = f"127.0.0.1:{server.getsockname()[1]}"
    worker_args = ["--control", control, "--hidden", str(hidden)] + (["--pin"] if args.pin else [])
    if args.device != "cpu" or args.process_group != "gloo":  # the CPU run's workers as before
        worker_args += ["--device", args.device, "--process-group", args.process_group]
    names = [(m, a) for a in allocators for m in modes]
    blocks: dict[str, list[dict]] = {f"{m}/{a}": [] for m, a in names}
    try:
        for launch in range(args.launches):
            first, last = (n * args.rounds // args.launches for n in (launch, launch + 1))
            run_launch(launch, range(first, last), names, args, worker_args, tmp, server,
                       step_s, blocks)  # fmt: skip
    finally:
        server.close()
    by_allocator = {a: {m: blocks[f"{m}/{a}"] for m in modes} for a in allocators}
    per_round = [row for a, bs in by_allocator.items() for row in round_rows(hidden, a, bs)]
    return [summarize(hidden, a, bs) for a, bs in by_allocator.items()], per_round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--hidden", type=int, nargs="+", default=[1000, 2500])
    parser.add_argument("--allocator", nargs="+", default=["default", "keep"],
                        choices=sorted(ALLOCATORS))  # fmt: skip
    parser.add_argument("--rounds", type=int, default=12, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=20, help="counted steps per block")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--launches", type=int, default=1,
        help="start every contender afresh this many times, the rounds split among them: "
        "glibc's default allocator moves with each process's history, so one launch's ratio "
        "is one draw (bench/NOTES.md, 'Seventh pass'); drift spans launches, so measure "
        "it with 1",
    )  # fmt: skip
    parser.add_argument(
        "--contenders", nargs="+", default=["plain", "ft", "torchft"],
        help="plain, ft and torchft (skipped when torchft is not installed)",
    )  # fmt: skip
    parser.add_argument(
        "--pin", action="store_true", help="each rank (replica group) on a core of its own"
    )
    parser.add_argument("--profile", default="", help="directory for torch.profiler tables")
    parser.add_argument(
        "--ft-baseline", default="",
        help="a checkout of torchft_like (e.g. `git archive` of an older commit) to run as one "
        "more contender, ftbase: a before/after of a change in one interleaved run",
    )  # fmt: skip
    parser.add_argument(
        "--lighthouse-code", default="",
        help="a checkout (e.g. `git archive HEAD`) whose lighthouse package serves ft and "
        "ftbase: work under way in this tree's lighthouse/ then does not change the run",
    )  # fmt: skip
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cuda: the model and data on the GPU (rank r of plain DDP and replica group g on "
        "GPU r (g) modulo the GPUs), both contenders' groups gloo unless --process-group nccl",
    )  # fmt: skip
    parser.add_argument(
        "--process-group", choices=("gloo", "nccl"), default="gloo",
        help="plain DDP's backend and our replicas' group (ProcessGroupNCCL); nccl needs "
        "--device cuda and two GPUs (NCCL takes one rank per GPU)",
    )  # fmt: skip
    add_common_args(parser)
    args = parser.parse_args()
    if args.device == "cuda" or args.process_group == "nccl":
        import torch

        if args.device != "cuda":
            parser.error("--process-group nccl needs --device cuda")
        if not torch.cuda.is_available():
            parser.error("--device cuda, but torch.cuda.is_available() is False on this machine")
        if args.process_group == "nccl" and torch.cuda.device_count() < 2:
            parser.error("--process-group nccl needs two GPUs: NCCL takes one rank per GPU")
    if args.lighthouse_code:
        if not (Path(args.lighthouse_code) / "lighthouse").is_dir():
            raise ValueError(f"--lighthouse-code {args.lighthouse_code} has no lighthouse/")
        LIGHTHOUSE_CODE[0] = str(Path(args.lighthouse_code).resolve())
    if args.smoke:
        args.hidden, args.steps, args.warmup, args.rounds, args.launches = [64], 3, 2, 2, 2
        args.contenders, args.allocator = ["plain", "ft"], ["default"]
    have_torchft = importlib.util.find_spec("torchft") is not None
    modes = [m for m in args.contenders if m != "torchft" or have_torchft]
    if args.ft_baseline:
        if not (Path(args.ft_baseline) / "torchft_like").is_dir():
            raise ValueError(f"--ft-baseline {args.ft_baseline} has no torchft_like/ package")
        modes.append("ftbase")
    if "plain" not in modes:
        raise ValueError(f"--contenders {args.contenders} must include plain: ratios are to it")
    if args.rounds < 2 or args.steps < 1:
        raise ValueError(f"need --rounds >= 2 and --steps >= 1, got {args.rounds}, {args.steps}")
    if not 1 <= args.launches <= args.rounds:
        raise ValueError(
            f"--launches {args.launches} must be 1 to --rounds ({args.rounds}): "
            "each launch needs a round of its own"
        )
    rows, rounds = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for hidden in args.hidden:
            summary, per_round = measure(hidden, modes, args.allocator, args, Path(tmp))
            rows += summary
            rounds += per_round
    report(rows, results_file(args.out, "step_overhead"))
    path = REPO / results_file(args.out, "step_overhead_rounds")
    with open(path, "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rounds)
    print(f"per-round medians appended to {path}")


if __name__ == "__main__":
    main()
