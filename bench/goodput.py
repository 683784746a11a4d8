"""Goodput under a fixed schedule of SIGKILLs: torchft_like (with and without
a hot spare), pytorch/torchft and checkpoint-restart, side by side, in one run.

    .venv/bin/python -m bench.goodput                      # 40 s fault-free + 100 s faulted each
    .venv/bin/python -m bench.goodput --quick              # 6 s each, one kill, 3 contenders
    .venv/bin/python -m bench.goodput --json results.json  # also every figure and run as JSON

Each contender trains the MLP of bench._goodput_data (64 -> 256 x 3 -> 10,
AdamW) on a synthetic data set of 9216 samples that carry their ids, 3 x 32
samples a step, on 127.0.0.1. Each step sleeps --step-sleep (0.05 s) after
its forward pass, standing for a device's compute: without it the 3 groups
share this machine's cores, and a dead group's share only speeds up the
others, which hides what a fault costs where each group has its own device.

- torchft_like: a lighthouse (`torchft-lighthouse`) and 3 replica groups,
  each its own `torchrun --nproc-per-node 1` (bench._goodput_ft): Manager,
  DistributedDataParallel and StepBatches over torchft_like's
  DistributedSampler. The killed group's torchrun is started again at once,
  as a supervisor would, and heals from the others.
- torchft_like+spare: the same, every group started with --spare, plus one
  spare: the lighthouse hands the dead group's place to the spare; the
  restarted torchrun becomes the next spare.
- torchft: pytorch/torchft's Manager and DDP under its Rust lighthouse
  (`torchft_lighthouse`), its DistributedSampler over the groups and a loop
  that takes the next batch every iteration, committed or not (its
  train_ddp.py); restarted at once like torchft_like.
- checkpoint_restart: one `torchrun --nproc-per-node 3 --max-restarts N` job
  of plain torch DDP over gloo (bench._goodput_ckpt), torch.save of model,
  optimizer and data position every --ckpt-every steps; SIGKILL of one
  worker makes torchrun restart all, from the newest checkpoint.

Per contender, a fault-free run of --fault-free-s seconds (0: the stretch
before the first kill of the faulted run), then the faulted run of
--seconds. A run's clock starts when every group (rank) has committed a step,
so the first start-up is not counted (every restart's is). Every --kill-every
seconds a seeded choice of group (the same sequence for every contender) is
SIGKILLed: its whole torchrun tree, or for checkpoint_restart the worker of
that local rank. A group (torchrun) that exits by itself is restarted too.

Reported (definitions in bench._goodput_account): goodput_pct = distinct
samples of the final history trained per second over the contender's own
fault-free rate; vs_prekill_pct, over its rate in the same faulted run
before the first kill (a baseline minutes closer, when other work on the
machine moves the rates); vs_torchft_like_pct, over torchft_like's
fault-free rate; samples lost, trained twice, rolled back; steps committed,
failed (not committed by the group) and, for checkpoint_restart, rolled
back; the longest stretch with no commit anywhere; replace_s, per kill, the
seconds until the killed group's replacement (restart or spare) commits, or
for checkpoint_restart until the restarted job trains; the faults injected;
the window.
"""

from __future__ import annotations

import argparse
import compileall
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench import _goodput_account as acc
from bench._goodput_data import NUM_SAMPLES
from bench._report import REPO, add_common_args, report, results_file
from tools.procs import kill_tree, read_jsonl, spawn, tree

VENV_BIN = Path(sys.executable).parent
CONTENDERS = ("torchft_like", "torchft_like+spare", "torchft", "checkpoint_restart")
FT_WORKER = "bench._goodput_ft"
CKPT_WORKER = "bench._goodput_ckpt"
LISTENING = re.compile(rb"[Ll]ighthouse listening on:? http://[^\s:/]+:(\d+)")

parser = argparse.ArgumentParser(
    description=" ".join(__doc__.split("\n\n")[0].split()),
    allow_abbrev=False,
    epilog="outputs: the table on stdout, JSON lines appended under --out, --json PATH",
)
add_common_args(parser)  # --smoke: as --quick
parser.add_argument(
    "--quick",
    action="store_true",
    help="short runs (as --smoke): 6 s windows, one kill, the fault-free rate from before it, "
    "and unless --contenders says otherwise torchft_like+spare, torchft, checkpoint_restart",
)
parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated")
parser.add_argument("--seconds", type=float, default=100, help="faulted window per contender")
parser.add_argument(
    "--fault-free-s", type=float, default=40,
    help="fault-free run's window (0: the faulted run's stretch before its first kill)",
)  # fmt: skip
parser.add_argument("--kill-every", type=float, default=30, help="seconds between SIGKILLs")
parser.add_argument("--seed", type=int, default=0, help="victims' seed; also data and weights")
parser.add_argument("--hidden", type=int, default=256, help="MLP width")
parser.add_argument("--layers", type=int, default=3, help="hidden layers of the MLP")
parser.add_argument("--batch-size", type=int, default=32, help="samples per group per step")
parser.add_argument(
    "--step-sleep", type=float, default=0.05,
    help="seconds each step sleeps after its forward pass: a device's compute, which takes no "
    "host core (0: the 3 groups share this machine's cores, and a dead group's share speeds up "
    "the others)",
)  # fmt: skip
parser.add_argument("--ckpt-every", type=int, default=20, help="checkpoint_restart: steps")
parser.add_argument("--heartbeat-timeout-ms", type=int, default=1000, help="both lighthouses")
parser.add_argument("--join-timeout-ms", type=int, default=1000, help="both lighthouses")
parser.add_argument("--start-timeout", type=float, default=120, help="seconds to first commits")
parser.add_argument("--json", default=None, help="write every figure and run here as JSON")
parser.add_argument("--keep", action="store_true", help="keep the workers' logs (path printed)")

GROUPS = 3


@dataclass
class Launch:
    """One process tree the harness started, and what it was started as."""

    proc: subprocess.Popen
    log: Path
    group: int | None
    """The group it was started as (None: a spare with no group)."""
    killed: bool = False


@dataclass
class Job:
    """Every process of one run; `stop` kills their trees."""

    out: Path
    deadline: float
    launches: list[Launch] = field(default_factory=list)
    files: list[Any] = field(default_factory=list)

    def start(self, cmd: list[str], name: str, env: dict[str, str], group: int | None,
              log: Path | None = None) -> Launch:  # fmt: skip
        self.files.append(open(self.out / f"{name}.out", "ab"))
        # coreutils timeout: the tree's root dies at the run's deadline, whatever happens here
        limit = ["timeout", "-s", "KILL", str(max(int(self.deadline - time.time()), 1))]
        launch = Launch(spawn(limit + cmd, self.files[-1], env, REPO), log or Path(), group)
        self.launches.append(launch)
        return launch

    def stop(self) -> None:
        seen = [p for launch in self.launches for p in tree(launch.proc.pid)]
        for launch in self.launches:
            kill_tree(launch.proc.pid)
            launch.proc.wait()
        for p in seen:  # a worker whose torchrun died first
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        for f in self.files:
            f.close()


def lighthouse_port(job: Job, launch: Launch, name: str) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        match = LISTENING.search((job.out / f"{name}.out").read_bytes())
        if match:
            return int(match.group(1))
        if launch.proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"{name} did not start: {(job.out / f'{name}.out').read_text()[-2000:]}")


def wait_for(what: str, ready: Any, job: Job, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        if gone := [ln for ln in job.launches if ln.proc.poll() is not None]:
            rc = gone[0].proc.returncode
            raise RuntimeError(f"a process exited ({rc}) before {what}; logs in {job.out}")
        time.sleep(0.1)
    raise TimeoutError(f"{what} not within {timeout:.0f} s; logs in {job.out}")


def victims(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(GROUPS) for _ in range(count)]


def common_worker_args(args: argparse.Namespace, deadline: float) -> list[str]:
    return [
        "--deadline", str(deadline), "--hidden", str(args.hidden), "--layers", str(args.layers),
        "--batch-size", str(args.batch_size), "--seed", str(args.seed),
        "--step-sleep", str(args.step_sleep),
    ]  # fmt: skip


def run_replica_groups(
    contender: str, args: argparse.Namespace, out: Path, window: float, kill_every: float
) -> dict[str, Any]:
    """One run of torchft_like(+spare) or torchft; kills every `kill_every` s
    (0: none) for `window` s after every group's first commit."""
    out.mkdir(parents=True)
    impl = "torchft" if contender == "torchft" else "torchft_like"
    spare = contender.endswith("+spare")
    job = Job(out, time.time() + args.start_timeout + window + 60)
    if impl == "torchft":
        cmd = [str(VENV_BIN / "torchft_lighthouse"), "--min_replicas", "1",
               "--bind", "127.0.0.1:0", "--heartbeat_timeout_ms", str(args.heartbeat_timeout_ms),
               "--join_timeout_ms", str(args.join_timeout_ms)]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "lighthouse", "--min-replicas", "1",
               "--bind", "127.0.0.1:0", "--http-bind", "",
               "--heartbeat-timeout-ms", str(args.heartbeat_timeout_ms),
               "--join-timeout-ms", str(args.join_timeout_ms)]  # fmt: skip
    lighthouse = job.start(cmd, "lighthouse", {}, None)
    events: dict[str, Any] = {"kills": [], "restarts": [], "crashes": []}
    try:
        address = f"http://127.0.0.1:{lighthouse_port(job, lighthouse, 'lighthouse')}"

        def launch(group: int | None) -> Launch:
            n = len(job.launches)
            log = out / f"launch{n}.jsonl"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "1", "-m", FT_WORKER, "--impl", impl, "--log-json", str(log),
                   *common_worker_args(args, job.deadline)]  # fmt: skip
            env = {"TORCHFT_LIGHTHOUSE": address, "NUM_REPLICA_GROUPS": str(GROUPS)}
            if group is not None:
                env["REPLICA_GROUP_ID"] = str(group)
            if spare:
                cmd.append("--spare")
            return job.start(cmd, f"launch{n}", env, group, log)

        for g in range(GROUPS):
            launch(g)
        if spare:
            launch(None)

        def started() -> float | None:
            """Every group's first commit (and the spare waiting): the latest of them."""
            firsts: dict[int, float] = {}
            waiting = False
            for ln in job.launches[1:]:
                records = read_jsonl(ln.log)
                group = next((r["group"] for r in records if r["event"] == "start"), None)
                waiting |= group is None and any(r["event"] == "spare_ready" for r in records)
                commit = next((r["t"] for r in records if r.get("committed")), None)
                if group is not None and commit is not None:
                    firsts[group] = min(commit, firsts.get(group, commit))
            if len(firsts) < GROUPS or (spare and not waiting):
                return None
            return max(firsts.values())

        t0 = wait_for("every group's first commit", started, job, args.start_timeout)
        end = t0 + window
        count = int(window // kill_every) if kill_every else 0
        kill_times = [t for t in (t0 + kill_every * (i + 1) for i in range(count)) if t < end]
        schedule = list(zip(kill_times, victims(args.seed, len(kill_times))))

        def holder(group: int) -> Launch | None:
            """The live launch training as `group` now."""
            for ln in reversed(job.launches[1:]):
                if ln.proc.poll() is not None or ln.killed:
                    continue
                starts = [r["group"] for r in read_jsonl(ln.log) if r["event"] == "start"]
                if (starts[-1] if starts else None if spare else ln.group) == group:
                    return ln
            return None

        while time.time() < end:
            if lighthouse.proc.poll() is not None:
                raise RuntimeError(f"{contender}: the lighthouse exited; logs in {out}")
            for ln in job.launches[1:]:
                if not ln.killed and ln.proc.poll() is not None:  # exited by itself
                    ln.killed = True
                    events["crashes"].append({"t": time.time(), "group": ln.group})
                    launch(ln.group)
            if schedule and time.time() >= schedule[0][0]:
                _, victim = schedule.pop(0)
                target = holder(victim)
                if target is None:
                    events["kills"].append({"t": time.time(), "group": victim, "missed": True})
                    continue
                target.killed = True
                kill_tree(target.proc.pid)
                events["kills"].append({"t": time.time(), "group": victim})
                target.proc.wait()
                # The supervisor restarts it at once (with a spare: as the next spare).
                launch(victim)
                events["restarts"].append({"t": time.time(), "group": victim})
            time.sleep(0.02)
    finally:
        job.stop()
    logs = [read_jsonl(ln.log) for ln in job.launches[1:]]
    trainings = acc.replica_group_trainings(logs, end)
    figures = acc.account(trainings, t0, end, args.seed, GROUPS * args.batch_size)
    commits = [r["t"] for records in logs for r in records if r.get("committed")]
    figures.update(
        replace_s=acc.replacement_times(logs, events["kills"], end),
        steps=acc.committed_steps(logs, t0, end),
        failed_steps=sum(
            1
            for rs in logs
            for r in rs
            if r["event"] == "step" and not r["committed"] and t0 < r["t"] <= end
        ),  # fmt: skip
        rolled_back_steps=0,
        longest_stall_s=acc.longest_stall(commits, t0, end),
    )
    return {"t0": t0, "end": end, "window_s": window, "events": events, **figures}


def run_checkpoint_restart(
    args: argparse.Namespace, out: Path, window: float, kill_every: float
) -> dict[str, Any]:
    """One run of the checkpoint-restart job (see the module)."""
    out.mkdir(parents=True)
    (out / "ckpt").mkdir()
    job = Job(out, time.time() + args.start_timeout + window + 60)
    kills_planned = int(window // kill_every) if kill_every else 0
    events: dict[str, Any] = {"kills": [], "restarts": [], "crashes": []}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(GROUPS), "--max-restarts", str(kills_planned + 10),
           "-m", CKPT_WORKER, "--rank-logs", str(out), "--ckpt-dir", str(out / "ckpt"),
           "--every", str(args.ckpt_every), *common_worker_args(args, job.deadline)]  # fmt: skip
    rank_logs = [out / f"rank{r}.jsonl" for r in range(GROUPS)]
    # torchrun's rendezvous store outlives a restart, and the workers' gloo
    # rendezvous keys in it are not per attempt: a restarted worker can read
    # a dead one's address (Connection refused) and fail the restart. A store
    # per rendezvous round avoids that (torch 2.13).
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    torchrun = job.start(cmd, "torchrun", env, None)
    try:

        def started() -> float | None:
            firsts = [next((r["t"] for r in read_jsonl(p) if r["event"] == "step"), None)
                      for p in rank_logs]  # fmt: skip
            return None if None in firsts else max(firsts)  # type: ignore[type-var]

        t0 = wait_for("every rank's first step", started, job, args.start_timeout)
        end = t0 + window
        kill_times = [t0 + kill_every * (i + 1) for i in range(kills_planned)]
        schedule = [
            (t, v) for t, v in zip(kill_times, victims(args.seed, kills_planned)) if t < end
        ]

        def worker(local_rank: int) -> psutil.Process | None:
            for p in tree(torchrun.proc.pid):
                try:
                    if (CKPT_WORKER in " ".join(p.cmdline())
                            and p.environ().get("LOCAL_RANK") == str(local_rank)):  # fmt: skip
                        return p
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            return None

        while time.time() < end:
            if torchrun.proc.poll() is not None:  # out of restarts, or failed: start it again
                events["crashes"].append({"t": time.time(), "rc": torchrun.proc.returncode})
                torchrun.killed = True
                torchrun = job.start(cmd, f"torchrun{len(job.launches)}", env, None)
            if schedule and time.time() >= schedule[0][0]:
                target = worker(schedule[0][1])
                if target is not None:  # else: mid-restart; try again shortly
                    _, victim = schedule.pop(0)
                    target.kill()
                    events["kills"].append({"t": time.time(), "group": victim})
            time.sleep(0.02)
    finally:
        job.stop()
    logs = [read_jsonl(p) for p in rank_logs]
    kills_before_end = len(events["kills"])
    trainings, back_to = acc.checkpoint_trainings(logs, end, kills_before_end)
    figures = acc.account(trainings, t0, end, args.seed, GROUPS * args.batch_size)
    kept, rolled = acc.checkpoint_steps(logs, t0, end, back_to)
    commits = [r["t"] for r in logs[0] if r["event"] == "step"
               and r["step"] <= back_to.get(r["inc"], r["step"])]  # fmt: skip
    figures.update(
        replace_s=acc.restart_times(logs, events["kills"], end),
        steps=kept,
        failed_steps=0,
        rolled_back_steps=rolled,
        longest_stall_s=acc.longest_stall(commits, t0, end),
    )
    events["rolled_back_to"] = back_to
    return {"t0": t0, "end": end, "window_s": window, "events": events, **figures}


def run(
    contender: str, args: argparse.Namespace, out: Path, window: float, kill_every: float
) -> dict[str, Any]:
    if contender == "checkpoint_restart":
        return run_checkpoint_restart(args, out, window, kill_every)
    return run_replica_groups(contender, args, out, window, kill_every)


def git_commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    dirty = git(
        "status", "--porcelain", "--untracked-files=no", "--", "torchft_like", "lighthouse", "bench"
    )
    head = git("rev-parse", "--short", "HEAD") or "unknown (not a git checkout)"
    return head + (" (+ uncommitted changes)" if dirty else "")


def main() -> int:
    args = parser.parse_args()
    if args.smoke or args.quick:
        args.seconds, args.kill_every, args.fault_free_s = 6, 3, 0
        args.hidden, args.layers, args.step_sleep = 64, 2, 0.01
        if args.contenders == parser.get_default("contenders"):
            # torchft_like without a spare runs the same code as with one, less the
            # spare. The CI smoke run (tests/e2e/test_bench_smoke.py) takes the
            # spare's alone: the driver, a kill, a takeover and the accounting.
            args.contenders = "torchft_like+spare,torchft,checkpoint_restart"
            if args.smoke:
                args.contenders = "torchft_like+spare"
    contenders = args.contenders.split(",")
    for c in contenders:
        if c not in CONTENDERS:
            parser.error(f"--contenders: {c!r} is unknown; pick from {','.join(CONTENDERS)}")
    if args.fault_free_s == 0 and args.kill_every <= 0:
        parser.error("--fault-free-s 0 takes the stretch before the first kill: needs --kill-every")
    if "torchft" in contenders and not (VENV_BIN / "torchft_lighthouse").exists():
        print("pytorch/torchft is not installed (pip install -e '.[bench]'): measuring without it")
        contenders.remove("torchft")
    for package in ("lighthouse", "torchft_like", "bench"):  # as an install would (recovery.py)
        compileall.compile_dir(REPO / package, quiet=1)
    commit = git_commit()
    started = time.time()
    root = Path(tempfile.mkdtemp(prefix="bench_goodput_"))
    results: dict[str, Any] = {}
    for c in contenders:
        name = c.replace("+", "_")
        if args.fault_free_s:
            free = run(c, args, root / f"{name}_fault_free", args.fault_free_s, 0)
        else:
            faulted = run(c, args, root / name, args.seconds, args.kill_every)
            free = run_segment(c, args, root / name, faulted)
        print(f"{c} fault-free: {free['samples_per_s']:.1f} samples/s", flush=True)
        if args.fault_free_s:
            faulted = run(c, args, root / name, args.seconds, args.kill_every)
        if args.kill_every:
            faulted["pre_kill"] = run_segment(c, args, root / name, faulted)
        print(f"{c} faulted: {faulted['samples_per_s']:.1f} samples/s, lost {faulted['lost']}, "
              f"twice {faulted['twice']}", flush=True)  # fmt: skip
        results[c] = {"fault_free": free, "faulted": faulted}
    reference = results.get("torchft_like", {}).get("fault_free", {}).get("samples_per_s")
    rows = [row(c, r, reference) for c, r in results.items()]
    elapsed = time.time() - started
    print(
        f"\ngoodput, {GROUPS} groups x 1 rank, MLP 64 -> {args.hidden} x {args.layers} -> 10, "
        f"{args.batch_size} samples/group/step, {NUM_SAMPLES} samples, SIGKILL every "
        f"{args.kill_every:g} s (seed {args.seed}), {args.seconds:g} s windows, fault-free "
        + (
            f"runs of {args.fault_free_s:g} s"
            if args.fault_free_s
            else "stretch before the first kill"
        )
        + f", heartbeat/join timeout {args.heartbeat_timeout_ms}/{args.join_timeout_ms} ms, "
        f"checkpoint every {args.ckpt_every} steps; commit {commit}; {elapsed:.0f} s in all"
    )
    report(rows, results_file(args.out, "goodput"))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"commit": commit, "args": vars(args), "elapsed_s": elapsed, "rows": rows,
             "runs": results}, indent=1, default=str))  # fmt: skip
        print(f"wrote {args.json}")
    if args.keep:
        print(f"logs: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def run_segment(
    contender: str, args: argparse.Namespace, out: Path, faulted: dict[str, Any]
) -> dict[str, Any]:
    """The fault-free figures of the faulted run's stretch before its first kill."""
    t0, end = faulted["t0"], faulted["t0"] + args.kill_every
    if contender == "checkpoint_restart":
        logs = [read_jsonl(out / f"rank{r}.jsonl") for r in range(GROUPS)]
        trainings, _ = acc.checkpoint_trainings(logs, end, 0)
    else:
        logs = [read_jsonl(p) for p in sorted(out.glob("launch*.jsonl"))]
        trainings = acc.replica_group_trainings(logs, end)
    return {"t0": t0, "end": end, "window_s": end - t0,
            **acc.account(trainings, t0, end, args.seed, GROUPS * args.batch_size)}  # fmt: skip


def row(contender: str, result: dict[str, Any], reference: float | None) -> dict[str, Any]:
    free, faulted = result["fault_free"], result["faulted"]
    rate = faulted["samples_per_s"]

    def pct(base: float | None) -> float | None:
        return round(100 * rate / base, 1) if base else None

    return {
        "contender": contender,
        "goodput_pct": pct(free["samples_per_s"]),
        "vs_prekill_pct": pct(faulted["pre_kill"]["samples_per_s"])
        if "pre_kill" in faulted
        else None,
        "vs_torchft_like_pct": pct(reference),
        "fault_free_per_s": round(free["samples_per_s"], 1),
        "faulted_per_s": round(rate, 1),
        "samples": faulted["samples"],
        "lost": faulted["lost"],
        "twice": faulted["twice"],
        "rolled_back": faulted["rolled_back_samples"],
        "steps": faulted["steps"],
        "failed_steps": faulted["failed_steps"],
        "rolled_back_steps": faulted["rolled_back_steps"],
        "longest_stall_s": round(faulted["longest_stall_s"], 2),
        "replace_s": "/".join("-" if t is None else f"{t:.1f}" for t in faulted["replace_s"])
        or "-",
        "faults": len(faulted["events"]["kills"]),
        "window_s": round(faulted["window_s"], 1),
    }


if __name__ == "__main__":
    sys.exit(main())
