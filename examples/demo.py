"""Kill-and-recover demo: the project's main job, on this one machine.

    .venv/bin/python examples/demo.py            # no argument needed

Starts a lighthouse and replica groups (each a real `torchrun` running
examples/train_ddp.py; with `--example diloco` examples/train_diloco.py, a
small transformer LM trained with DiLoCo; with `--example fsdp`
examples/train_fsdp.py, a transformer LM sharded with FSDP2 inside each
group), SIGKILLs one group's whole process tree mid-training, restarts it,
lets it heal from a live peer, trains to the end, then prints a summary,
says whether the replicas ended bit-identical, and draws the step timeline
of each group (PNG) with the kill and the recovery marked.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn, TextIO

REPO = Path(__file__).resolve().parent.parent
# Run as a script, Python puts examples/ on sys.path, not the repository root
# that holds tools/ (repository tooling, not installed with the library).
sys.path.insert(0, str(REPO))

from tools.procs import free_port, kill_tree, read_jsonl, spawn  # noqa: E402

# --- arguments --------------------------------------------------------------


class OneLineErrorParser(argparse.ArgumentParser):
    """Says a mistake in one line, not under the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists every option)\n")


parser = OneLineErrorParser(
    allow_abbrev=False,  # a misspelled flag is an error, not a prefix match
    description="torchft_like kill-and-recover demo",
    epilog="""\
environment: the demo reads none itself; its lighthouse and training groups
inherit it, so e.g. TORCHFT_SECRET_FILE (a file holding a shared secret)
turns access control on for the whole demo. It sets TORCHFT_LIGHTHOUSE,
REPLICA_GROUP_ID and NUM_REPLICA_GROUPS for its groups itself.

example:
  .venv/bin/python examples/demo.py --groups 3 --victim 2 --steps 300
""",
    formatter_class=argparse.RawDescriptionHelpFormatter,
)
parser.add_argument(
    "--example",
    choices=("ddp", "diloco", "fsdp"),
    default="ddp",
    help="ddp: examples/train_ddp.py (an MLP, a full copy per rank, a sync every step); "
    "diloco: examples/train_diloco.py (a small transformer LM, DiLoCo: a sync every "
    "--sync-every inner steps; a step is then a sync); fsdp: examples/train_fsdp.py "
    "(a transformer LM sharded over each group's ranks, FT-HSDP)",
)
parser.add_argument("--groups", type=int, default=2, help="replica groups")
parser.add_argument("--nproc-per-group", type=int, default=1, help="ranks per replica group")
parser.add_argument(
    "--steps", type=int, default=None, help="committed steps to train (default 400; diloco: 30)"
)
parser.add_argument("--sync-every", type=int, default=10, help="diloco: inner steps per sync")
parser.add_argument("--hidden", type=int, default=512, help="hidden width of the MLP (ddp)")
parser.add_argument("--kill-at-step", type=int, default=None, help="default: a third of --steps")
parser.add_argument("--victim", type=int, default=1, help="replica group to kill")
parser.add_argument("--restart-after", type=float, default=1.0, help="seconds before restarting")
parser.add_argument("--step-sleep", type=float, default=0.05, help="seconds each step sleeps")
parser.add_argument("--out", default="demo_out", help="folder for logs, JSON and the PNG")
parser.add_argument("--timeout", type=float, default=600, help="give up after this many seconds")
parser.add_argument(
    "--device",
    choices=("cpu", "cuda"),
    default="cpu",
    help="where every group trains: cuda puts each rank on cuda:(LOCAL_RANK %% GPUs) (one GPU "
    "can hold every group); the replicas' process group is gloo, which takes CUDA tensors",
)


class Job:
    """Every child process of the demo, each in its own session, killed at exit."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.procs: list[subprocess.Popen] = []

    def spawn(
        self, args: list[str], log_name: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        proc = spawn(args, open(self.out / log_name, "ab"), env, REPO)
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILLs the process and all its descendants (torchrun's workers)."""
        kill_tree(proc.pid)
        proc.wait()

    def kill_all(self) -> None:
        for proc in self.procs:
            self.kill(proc)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options with their defaults filled in; a bad value exits with one line."""
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 30 if args.example == "diloco" else 400
    if args.kill_at_step is None:
        args.kill_at_step = args.steps // 3
    for name in ("groups", "nproc_per_group", "steps", "sync_every", "hidden"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} ({getattr(args, name)}) must be at least 1")
    if not 0 <= args.victim < args.groups:
        parser.error(
            f"--victim ({args.victim}) must name one of the replica groups, 0 to "
            f"{args.groups - 1} (--groups {args.groups})"
        )
    if not 0 <= args.kill_at_step < args.steps:
        parser.error(
            f"--kill-at-step ({args.kill_at_step}) must be below --steps ({args.steps}) "
            "and not negative, so the restarted group has steps left to train"
        )
    for name in ("restart_after", "step_sleep"):
        if getattr(args, name) < 0:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} ({getattr(args, name)}) must not be negative")
    if args.timeout <= 0:
        parser.error(f"--timeout ({args.timeout}) must be positive (seconds)")
    if args.device == "cuda":
        import torch  # only here: the demo itself runs nothing on a device

        if not torch.cuda.is_available():
            parser.error("--device cuda, but torch.cuda.is_available() is False on this machine")
    return args


class Progress:
    """A bar redrawn in place on a terminal. Piped to a file or a CI job log,
    where a carriage return draws nothing, one line every `every_s` seconds
    and whenever the note changes, so a long run still shows it is alive."""

    def __init__(self, stream: TextIO, every_s: float = 5.0) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.every_s = every_s
        self.last_t: float | None = None
        self.last_note = ""

    def update(self, done: int, total: int, note: str, now: float) -> None:
        if self.tty:
            width = 30
            filled = int(width * min(done, total) / total)
            bar = f"[{'#' * filled}{'.' * (width - filled)}]"
            self.stream.write(f"\r{bar} {done}/{total} steps  {note:<40}")
        elif self.last_t is None or now - self.last_t >= self.every_s or note != self.last_note:
            self.last_t, self.last_note = now, note
            self.stream.write(f"progress: {done}/{total} steps{'  ' + note if note else ''}\n")
        else:
            return
        self.stream.flush()

    def end(self) -> None:
        """Ends the bar's line on a terminal."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def device_args(example: str, device: str) -> list[str]:
    """The training script's options for `device`. On the CPU, none but the
    device itself (train_ddp and train_fsdp would pick a GPU where there is
    one); on CUDA, gloo between the groups: NCCL refuses two groups' ranks
    on one GPU, and gloo gives the same bits on any number of GPUs."""
    if device == "cpu":
        return [] if example == "diloco" else ["--device", "cpu"]
    return ["--device", "cuda"] + (["--process-group", "gloo"] if example == "ddp" else [])


def main() -> int:
    args = parse_args()
    kill_at = args.kill_at_step
    out = REPO / args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    job = Job(out)
    python = sys.executable
    torchrun = [python, "-m", "torch.distributed.run"]

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        # --- lighthouse ------------------------------------------------------
        port = free_port()
        job.spawn(
            [
                python,
                "-m",
                "lighthouse",
                "--min-replicas",
                "1",
                "--bind",
                f"127.0.0.1:{port}",
                "--http-bind",
                "127.0.0.1:0",
                "--heartbeat-timeout-ms",
                "1000",
                "--join-timeout-ms",
                "1000",
            ],
            "lighthouse.log",
        )
        lighthouse = f"http://127.0.0.1:{port}"

        if args.example == "diloco":
            script = ["examples/train_diloco.py", "--sync-every", str(args.sync_every)]
        elif args.example == "fsdp":
            script = ["examples/train_fsdp.py"]
        else:
            script = ["examples/train_ddp.py", "--hidden", str(args.hidden)]
        script += device_args(args.example, args.device)

        def launch(group: int) -> subprocess.Popen:
            return job.spawn(
                torchrun
                + [
                    "--standalone",
                    "--nproc_per_node",
                    str(args.nproc_per_group),
                    *script,
                    "--steps",
                    str(args.steps),
                    "--step-sleep",
                    str(args.step_sleep),
                    "--log-json",
                    str(out / f"group{group}.jsonl"),
                ],
                f"group{group}.log",
                env={
                    "TORCHFT_LIGHTHOUSE": lighthouse,
                    "REPLICA_GROUP_ID": str(group),
                    "NUM_REPLICA_GROUPS": str(args.groups),
                },
            )

        groups = {g: launch(g) for g in range(args.groups)}
        print(
            f"lighthouse {lighthouse}; {args.groups} replica groups; "
            f"kill group {args.victim} at step {kill_at}"
        )
        events: dict[str, float] = {}
        progress = Progress(sys.stderr)
        deadline = time.time() + args.timeout
        while time.time() < deadline:
            steps = {
                g: max(
                    [
                        r["step"]
                        for r in read_jsonl(out / f"group{g}.jsonl")
                        if r["event"] == "step"
                    ],
                    default=0,
                )
                for g in groups
            }
            finished = {g: groups[g].poll() is not None for g in groups}
            note = "killed, restarting" if "kill" in events and "restart" not in events else ""
            progress.update(max(steps.values()), args.steps, note, time.monotonic())
            if "kill" not in events and steps[args.victim] >= kill_at:
                events["kill"] = time.time()
                job.kill(groups[args.victim])
            elif (
                "kill" in events
                and "restart" not in events
                and time.time() - events["kill"] >= args.restart_after
            ):
                groups[args.victim] = launch(args.victim)
                events["restart"] = time.time()
            if all(finished.values()):
                break
            crashed = [g for g in groups if groups[g].poll() not in (None, 0)]
            if crashed and not (crashed == [args.victim] and "restart" not in events):
                print(f"\nreplica group {crashed[0]} failed; see {out}/group{crashed[0]}.log")
                return 1
            time.sleep(0.1)
        else:
            print(f"\ngave up after {args.timeout:.0f} s; logs in {out}")
            return 1
        progress.end()
    except KeyboardInterrupt:
        print("\ninterrupted; stopping every process")
        return 130
    finally:
        job.kill_all()

    return report(out, args, events)


# --- report -----------------------------------------------------------------


def report(out: Path, args: argparse.Namespace, events: dict[str, float]) -> int:
    rows, finals = [], {}
    for g in range(args.groups):
        records = read_jsonl(out / f"group{g}.jsonl")
        steps = [r for r in records if r["event"] == "step"]
        final = next((r for r in reversed(records) if r["event"] == "final"), None)
        finals[g] = final
        row = {
            "group": g,
            "committed": sum(r["committed"] for r in steps),
            "missed": sum(not r["committed"] for r in steps),
            "final_loss": steps[-1]["loss"] if steps else float("nan"),
            "hash": final["hash"] if final else "-",
            "step": final["step"] if final else "-",
        }
        if g == args.victim and "restart" in events:
            starts = [
                r for r in records if r["event"] == "start" and r["t"] >= events["restart"] - 5
            ]
            after = [r for r in steps if r["t"] >= events["restart"]]
            first_commit = next((r for r in after if r["committed"]), None)
            if starts and first_commit:
                first = after[0]
                row["startup_s"] = starts[-1]["ready"] - events["restart"]
                row["quorum_s"] = first.get("quorum_s", 0.0)
                row["transfer_s"] = first.get("heal_recv_s", 0.0)
                row["restart_to_commit_s"] = first_commit["t"] - events["restart"]
        rows.append(row)

    print(
        "\n group | committed | missed | final step | final loss | state hash       "
        "| restart -> first commit"
    )
    for r in rows:
        recovery = ""
        if "restart_to_commit_s" in r:
            recovery = (
                f"{r['restart_to_commit_s']:.2f} s (start-up {r['startup_s']:.2f} s, "
                f"quorum {r['quorum_s']:.2f} s, transfer {r['transfer_s']:.3f} s)"
            )
        print(
            f" {r['group']:>5} | {r['committed']:>9} | {r['missed']:>6} | {r['step']!s:>10} | "
            f"{r['final_loss']:>10.4f} | {r['hash']:<16} | {recovery}"
        )
    hashes = {f["hash"] for f in finals.values() if f}
    same_step = len({f["step"] for f in finals.values() if f}) == 1
    identical = (
        len(finals) == args.groups and all(finals.values()) and len(hashes) == 1 and same_step
    )
    print("\nreplicas ended BIT-IDENTICAL" if identical else "\nreplicas did NOT end bit-identical")
    draw_timeline(out, args, events)
    (out / "summary.json").write_text(
        json.dumps({"groups": rows, "identical": identical, "events": events})
    )
    print(f"timeline: {out / 'timeline.png'}; logs: {out}")
    return 0 if identical else 1


def draw_timeline(out: Path, args: argparse.Namespace, events: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [r["t"] for g in range(args.groups) for r in read_jsonl(out / f"group{g}.jsonl")]
    if not times:
        return
    t0 = min(times)
    fig, ax = plt.subplots(figsize=(10, 4))
    for g in range(args.groups):
        steps = [r for r in read_jsonl(out / f"group{g}.jsonl") if r["event"] == "step"]
        ok: list[tuple[float, float]] = []
        for r in (r for r in steps if r["committed"]):
            if ok and r["step"] > ok[-1][1] + 1:  # a jump (healing): no line across it
                ok.append((float("nan"), float("nan")))
            ok.append((r["t"] - t0, r["step"]))
        missed = [(r["t"] - t0, r["step"]) for r in steps if not r["committed"]]
        healed = [(r["t"] - t0, r["step"]) for r in steps if r["healed"]]
        width = 2 * (args.groups - g) + 1  # later groups thinner, drawn on top
        line = (
            ax.plot(*zip(*ok), "-", linewidth=width, label=f"group {g} committed")[0]
            if ok
            else None
        )
        color = line.get_color() if line else None
        if missed:
            ax.plot(*zip(*missed), "x", color=color, label=f"group {g} not committed")
        if healed:
            ax.plot(*zip(*healed), "*", markersize=14, color=color, label=f"group {g} healed")
    for name, style in (("kill", "r--"), ("restart", "g--")):
        if name in events:
            ax.axvline(events[name] - t0, color=style[0], linestyle="--", label=name)
    ax.set_xlabel("seconds")
    ax.set_ylabel("committed step")
    ax.set_title("torchft_like: step timeline per replica group")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=100)


if __name__ == "__main__":
    sys.exit(main())
