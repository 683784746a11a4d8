"""Kill-and-recover benchmark: torchft_like vs pytorch/torchft, same schedule.

    .venv/bin/python -m bench.recovery            # ~8M params (~100 MB with AdamW), 3 repeats
    .venv/bin/python -m bench.recovery --smoke    # tiny model, 1 repeat, well under a minute

Per run: a lighthouse and two replica groups (torchrun, --nproc-per-group
ranks each); group 1's whole process tree is SIGKILLed at --kill-at-step and
restarted --restart-after seconds later: cold (torchft_like, torchft: a new
torchrun) or by handing its id to a warm standby started with the others
(standby: examples/train_ddp.py --standby-file; its start-up is not counted).
spare: no restart at all; every group runs with --spare, one more process
waits as a spare, and the lighthouse hands it the dead group's place (its
"restart" is the kill itself).
Reported per contender (medians over the repeats, contenders interleaved):
restart -> first committed step of the restarted group, split into start-up
(launch -> python, -> torch imported, -> Manager ready -> model wrapped; also
the worker's CPU seconds to torch imported and to ready, steadier than wall
time on a loaded machine), quorum, state transfer and the first step; the
survivor's usual interval between commits, its steps committed while its peer
was down, and its longest stall (longest gap between consecutive commits from
the kill to the rejoin), also split into the stall at the kill and the
interval of the rejoin step; and whether both groups end bit-identical (state
hash of model and optimizer, at least --after-rejoin steps after the rejoin).
"""

from __future__ import annotations

import argparse
import compileall
import json
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench._report import REPO, add_common_args, report, results_file
from tools.procs import free_port, kill_tree, read_jsonl, spawn, tree

VENV_BIN = Path(sys.executable).parent
CONTENDERS = {
    "torchft_like": "examples/train_ddp.py",
    # The same script kept as a warm standby (started with the others, before
    # the kill): the "restart" writes the dead group's id into its file.
    "standby": "examples/train_ddp.py",
    # Every group started with --spare, plus one spare: the lighthouse hands
    # the dead group's place to the spare, no operator, no restart.
    "spare": "examples/train_ddp.py",
    "torchft": "bench/_recovery_torchft.py",
}
REPLACEMENT = {"standby": "standby", "spare": "spare"}
"""Contenders whose replacement is a process started before the kill: its log name."""

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
add_common_args(parser)  # --smoke: tiny model, 1 repeat, short run
parser.add_argument("--repeats", type=int, default=3, help="runs per contender, interleaved")
parser.add_argument(
    "--contenders", default="torchft_like,standby,spare,torchft", help="comma-separated"
)
parser.add_argument("--hidden", type=int, default=2000, help="MLP width (2000: ~8.1M params)")
parser.add_argument("--layers", type=int, default=3, help="hidden layers of the MLP")
parser.add_argument("--nproc-per-group", type=int, default=1, help="ranks per replica group")
parser.add_argument("--kill-at-step", type=int, default=30, help="SIGKILL group 1 at this step")
parser.add_argument("--restart-after", type=float, default=1.0, help="seconds before restarting")
parser.add_argument("--after-rejoin", type=int, default=20, help="steps to train after rejoin")
parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps")
parser.add_argument("--heartbeat-timeout-ms", type=int, default=1000, help="lighthouse flag")
parser.add_argument("--join-timeout-ms", type=int, default=1000, help="lighthouse flag")
parser.add_argument(
    "--torchrun-args",
    default="--standalone",
    help="torchrun options for every group of both contenders ({port}: a free port), e.g. "
    "'--rdzv-backend static --master-addr 127.0.0.1 --master-port {port} --nnodes 1 "
    "--node-rank 0'",
)
parser.add_argument("--run-timeout", type=float, default=240, help="seconds per run")
parser.add_argument("--keep", action="store_true", help="keep the logs (path printed)")


def wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"nothing listens on 127.0.0.1:{port} after {timeout} s"
                ) from None
            time.sleep(0.01)


def lighthouse_cmd(contender: str, port: int, args: argparse.Namespace) -> list[str]:
    bind = f"127.0.0.1:{port}"
    if contender == "torchft":
        return [
            str(VENV_BIN / "torchft_lighthouse"),
            "--min_replicas", "1", "--bind", bind,
            "--heartbeat_timeout_ms", str(args.heartbeat_timeout_ms),
            "--join_timeout_ms", str(args.join_timeout_ms),
        ]  # fmt: skip
    return [
        sys.executable, "-m", "lighthouse", "--min-replicas", "1", "--bind", bind,
        "--http-bind", "", "--heartbeat-timeout-ms", str(args.heartbeat_timeout_ms),
        "--join-timeout-ms", str(args.join_timeout_ms),
    ]  # fmt: skip


def run_once(contender: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One kill-and-recover run; returns its figures."""
    out.mkdir(parents=True)
    procs: list[subprocess.Popen] = []
    logs: list[Any] = []

    def start(cmd: list[str], log: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        logs.append(open(out / log, "ab"))
        proc = spawn(cmd, logs[-1], env, REPO)
        procs.append(proc)
        return proc

    port = free_port()
    steps_file = out / "steps"
    try:
        lighthouse = start(lighthouse_cmd(contender, port, args), "lighthouse.log")
        wait_port(port, 10)

        def launch(group: int | str) -> subprocess.Popen:
            cmd = [sys.executable, "-m", "torch.distributed.run"]
            cmd += shlex.split(args.torchrun_args.replace("{port}", str(free_port())))
            cmd += ["--nproc_per_node", str(args.nproc_per_group), CONTENDERS[contender]]
            cmd += ["--steps", "1000000", "--stop-file", str(steps_file)]
            cmd += ["--hidden", str(args.hidden), "--step-sleep", str(args.step_sleep)]
            cmd += ["--layers", str(args.layers), "--log-json", str(out / f"group{group}.jsonl")]
            env = {"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "NUM_REPLICA_GROUPS": "2"}
            if group == "standby":
                cmd += ["--standby-file", str(out / "standby")]
            else:
                if group != "spare":
                    env["REPLICA_GROUP_ID"] = str(group)
                if contender == "spare":
                    cmd += ["--spare"]
            return start(cmd, f"group{group}.log", env)

        groups = {0: launch(0), 1: launch(1)}
        replacement = REPLACEMENT.get(contender)
        standby = launch(replacement) if replacement else None
        events: dict[str, float] = {}
        deadline = time.monotonic() + args.run_timeout
        while time.monotonic() < deadline:
            if "kill" not in events:
                # Both groups past the step: the survivor has a pace to measure.
                reached = [
                    max((r["step"] for r in read_jsonl(out / f"group{g}.jsonl") if "step" in r),
                        default=0)
                    for g in (0, 1)
                ]  # fmt: skip
                waiting = (
                    standby is None
                    or f"{replacement}: ready".encode()
                    in (out / f"group{replacement}.log").read_bytes()
                )
                if min(reached) >= args.kill_at_step and waiting:
                    cpu_at_kill = (cpu_seconds(groups[0].pid), cpu_seconds(lighthouse.pid))
                    events["kill"] = time.time()
                    kill_tree(groups[1].pid)
                    groups[1].wait()
                    if contender == "spare":  # nobody restarts anything: the lighthouse acts
                        events["restart"] = events["kill"]
                        groups[1] = standby
            elif "restart" not in events and time.time() - events["kill"] >= args.restart_after:
                if standby is None:
                    events["restart"] = time.time()
                    groups[1] = launch(1)
                else:
                    (out / "standby.tmp").write_text("1")
                    events["restart"] = time.time()
                    (out / "standby.tmp").rename(out / "standby")
                    groups[1] = standby
            elif "restart" in events and "rejoin" not in events:
                rejoin = [
                    r["step"]
                    for r in read_jsonl(out / f"group{replacement or 1}.jsonl")
                    if r["event"] == "step" and r["t"] >= events["restart"] and r["committed"]
                ]
                if rejoin:
                    # Both groups stop at the same step, --after-rejoin steps on.
                    events["rejoin"] = time.time()
                    down_s = events["rejoin"] - events["kill"]
                    events["survivor_cpu_per_s"] = (
                        cpu_seconds(groups[0].pid) - cpu_at_kill[0]
                    ) / down_s
                    events["lighthouse_cpu_per_s"] = (
                        cpu_seconds(lighthouse.pid) - cpu_at_kill[1]
                    ) / down_s
                    (out / "steps.tmp").write_text(str(rejoin[0] + args.after_rejoin))
                    (out / "steps.tmp").rename(steps_file)
            if "restart" in events and all(p.poll() is not None for p in groups.values()):
                break
            failed = [g for g, p in groups.items() if p.poll() not in (None, 0)]
            if failed and not (failed == [1] and "restart" not in events):
                raise RuntimeError(f"{contender}: group {failed[0]} failed; logs in {out}")
            time.sleep(0.02)
        else:
            raise TimeoutError(f"{contender}: run not done in {args.run_timeout} s; logs in {out}")
    finally:
        for proc in procs:
            kill_tree(proc.pid)
            proc.wait()
        for log in logs:
            log.close()
    (out / "events.json").write_text(json.dumps(events))
    return figures(contender, out, events)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its descendants so far."""
    total = 0.0
    for proc in tree(pid):
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def figures(contender: str, out: Path, events: dict[str, float]) -> dict[str, Any]:
    """The figures of one run, from both groups' JSON lines and the events."""
    survivor, victim = (read_jsonl(out / f"group{g}.jsonl") for g in (0, 1))
    restart, kill = events["restart"], events["kill"]
    if contender in REPLACEMENT:
        victim = read_jsonl(out / f"group{REPLACEMENT[contender]}.jsonl")
        start = next(r for r in victim if r["event"] == "start")
        # Its start-up ran before the kill; what counts is from the takeover.
        start = {**start, "t": restart, "torch_imported": restart, "cpu_ready": None,
                 "cpu_torch_imported": None}  # fmt: skip
    else:
        start = next(r for r in victim if r["event"] == "start" and r["t"] >= restart)
    after = [r for r in victim if r["event"] == "step" and r["t"] >= restart]
    first_commit = next(r for r in after if r["committed"])
    first = after[0]
    to_commit = first_commit["t"] - restart
    startup = start["ready"] - restart
    quorum = first.get("quorum_s", 0.0)
    transfer = first.get("heal_recv_s", 0.0)
    commits = [r for r in survivor if r["event"] == "step" and r["committed"]]
    before = [r["t"] for r in commits if r["t"] < kill]
    intervals = [b - a for a, b in zip(before, before[1:])]
    times = [r["t"] for r in commits]
    rejoin_t = first_commit["t"]
    finals = [
        next((r for r in reversed(g) if r["event"] == "final"), None) for g in (survivor, victim)
    ]
    identical = all(finals) and len({(f["step"], f["hash"]) for f in finals}) == 1  # type: ignore[index]
    return {
        "contender": contender,
        "restart_to_commit_s": round(to_commit, 3),
        "startup_s": round(startup, 3),
        "launch_to_python_s": round(start["t"] - restart, 3),
        "import_torch_s": round(start["torch_imported"] - start["t"], 3),
        "to_manager_s": round(start["manager_ready"] - start["torch_imported"], 3),
        "to_ready_s": round(start["ready"] - start["manager_ready"], 3),
        "startup_cpu_s": _round(start["cpu_ready"]),
        "import_torch_cpu_s": _round(start["cpu_torch_imported"]),
        "quorum_s": round(quorum, 3),
        "transfer_s": round(transfer, 3),
        "first_step_s": round(to_commit - startup - quorum - transfer, 3),
        "rejoin_step": first_commit["step"],
        "survivor_interval_s": round(statistics.median(intervals), 3) if intervals else None,
        "survivor_down_commits": sum(kill < r["t"] < first_commit["t"] for r in commits),
        "survivor_stall_s": longest_gap(times, kill, rejoin_t),
        "stall_at_kill_s": longest_gap(times, kill, restart),
        "stall_at_rejoin_s": step_gap(commits, first_commit["step"]),
        "survivor_cpu_per_s": round(events.get("survivor_cpu_per_s", float("nan")), 2),
        "lighthouse_cpu_per_s": round(events.get("lighthouse_cpu_per_s", float("nan")), 2),
        "after_rejoin": finals[0]["step"] - first_commit["step"] if finals[0] else None,
        "identical": bool(identical),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def longest_gap(times: list[float], start: float, end: float) -> float | None:
    """Longest gap between consecutive commit times around [start, end]: from
    the last commit before `start` to the first one after `end`."""
    points = [t for t in times if t < start][-1:]
    points += [t for t in times if start <= t <= end]
    points += [t for t in times if t > end][:1]
    if len(points) < 2:
        return None
    return round(max(b - a for a, b in zip(points, points[1:])), 3)


def step_gap(commits: list[dict[str, Any]], step: int) -> float | None:
    """Time between the commits of `step - 1` and `step`."""
    at = {r["step"]: r["t"] for r in commits}
    if step in at and step - 1 in at:
        return round(at[step] - at[step - 1], 3)
    return None


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"contender": runs[0]["contender"], "runs": len(runs)}
    for key in runs[0]:
        if key == "contender":
            continue
        values = [r[key] for r in runs if r[key] is not None]
        if key == "identical":
            row[key] = f"{sum(values)}/{len(runs)}"
        elif values:
            row[key] = round(statistics.median(values), 3)
        else:
            row[key] = None
    return row


def main() -> int:
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.repeats = 64, 2, 1
        args.kill_at_step, args.after_rejoin, args.step_sleep = 5, 5, 0.02
        if args.contenders == parser.get_default("contenders"):
            # The standby's path is the spare's but for who hands over the id,
            # and tests/e2e/test_spares.py runs the spare's.
            args.contenders = "torchft_like,torchft"
    contenders = args.contenders.split(",")
    for c in contenders:
        if c not in CONTENDERS:
            raise ValueError(f"contender {c!r} is unknown; pick from {sorted(CONTENDERS)}")
    if "torchft" in contenders and not (VENV_BIN / "torchft_lighthouse").exists():
        print("pytorch/torchft is not installed (pip install -e '.[bench]'): measuring without it")
        contenders.remove("torchft")
    # torchft's modules were byte-compiled when pip installed it; a source
    # checkout run with PYTHONDONTWRITEBYTECODE=1 (as on our CI box) compiles
    # ours on every start instead: 0.3-0.6 s per process on a loaded machine.
    # Compile them once, as an install would, so both start from bytecode.
    for package in ("lighthouse", "torchft_like"):
        compileall.compile_dir(REPO / package, quiet=1)
    root = Path(tempfile.mkdtemp(prefix="bench_recovery_"))
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
    for i in range(args.repeats):
        for c in contenders if i % 2 == 0 else contenders[::-1]:
            run = run_once(c, args, root / f"{c}_{i}")
            print(json.dumps(run), flush=True)
            runs[c].append(run)
    rows = [median_row(r) for r in runs.values()]
    print(
        f"\nrecovery, hidden {args.hidden} x {args.layers} layers, kill at step "
        f"{args.kill_at_step}, restart after {args.restart_after} s, heartbeat timeout "
        f"{args.heartbeat_timeout_ms} ms, join timeout {args.join_timeout_ms} ms, "
        f"torchrun {args.torchrun_args!r}; medians"
    )
    report(rows, results_file(args.out, "recovery"))
    for c, rs in runs.items():
        values = [r["restart_to_commit_s"] for r in rs]
        print(f"{c}: restart -> first commit min {min(values):.3f} max {max(values):.3f} s")
    reference = next((r for r in rows if r["contender"] == "torchft"), None)
    for row in rows:
        if reference and row is not reference and reference["restart_to_commit_s"]:
            ratio = row["restart_to_commit_s"] / reference["restart_to_commit_s"]
            print(f"{row['contender']} / torchft, restart -> first commit: {ratio:.2f}")
    if args.keep:
        print(f"logs: {root}")
    else:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r["identical"] for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
