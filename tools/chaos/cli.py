"""The chaos runner's command line: options, the schedule, the run and its cleanup."""

from __future__ import annotations

import argparse
import logging
import shutil
import signal
from pathlib import Path

from tools.chaos.children import DEFAULT_SCRIPT, SCRIPT_CONTRACT, Children
from tools.chaos.report import report
from tools.chaos.runner import Runner
from tools.chaos.schedule import (
    BASIC_KINDS,
    CORRELATED_KINDS,
    FaultKind,
    ScheduleConfig,
    make_schedule,
    parse_kinds,
)

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        allow_abbrev=False,  # a misspelled flag is an error, not a prefix match
        prog="python -m tools.chaos",
        description="torchft_like chaos runner",
        epilog=SCRIPT_CONTRACT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--script",
        type=Path,
        default=DEFAULT_SCRIPT,
        help="training script each group runs under torchrun (default: examples/train_ddp.py "
        "of this repository); what it must accept and log is below",
    )
    p.add_argument("--groups", type=int, default=3, help="replica groups")
    p.add_argument("--nproc-per-group", type=int, default=2, help="ranks per replica group")
    p.add_argument("--steps", type=int, default=200, help="committed steps to train")
    p.add_argument("--faults", type=int, default=8, help="faults to inject")
    kinds = p.add_mutually_exclusive_group()
    kinds.add_argument(
        "--kinds",
        default=_names(BASIC_KINDS),
        help="comma list of fault kinds, cycled in a seeded order (default: "
        f"{_names(BASIC_KINDS)}; all: {_names(tuple(FaultKind))})",
    )
    kinds.add_argument(
        "--correlated",
        action="store_true",
        help=f"correlated faults only, several victims in the same second: --kinds "
        f"{_names(CORRELATED_KINDS)} (the two-group kinds need --groups 3 or more)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the schedule and restart delays")
    p.add_argument("--out", default="demo_out/chaos", help="folder for logs and summary.json")
    p.add_argument("--min-delay-s", type=float, default=0.5, help="shortest down time")
    p.add_argument("--max-delay-s", type=float, default=3.0, help="longest down time")
    p.add_argument("--warmup-steps", type=int, default=10, help="no fault before this step")
    p.add_argument("--tail-steps", type=int, default=5, help="no fault in the last steps")
    p.add_argument("--hidden", type=int, default=32, help="hidden width of the MLP")
    p.add_argument(
        "--loader",
        choices=("plain", "stateful"),
        default=None,
        help="passed on to the script as --loader (examples/train_ddp.py)",
    )
    p.add_argument("--step-sleep", type=float, default=0.1, help="seconds each step sleeps")
    p.add_argument("--max-restarts", type=int, default=1,
                   help="torchrun --max-restarts: worker restarts before it dies")  # fmt: skip
    p.add_argument("--heartbeat-timeout-ms", type=int, default=1000, help="lighthouse option")
    p.add_argument("--join-timeout-ms", type=int, default=1000, help="lighthouse option")
    p.add_argument("--timeout-s", type=float, default=5, help="collective and vote timeout")
    p.add_argument("--quorum-timeout-s", type=float, default=20, help="one quorum's bound")
    p.add_argument("--settle-timeout-s", type=float, default=90,
                   help="a victim not committing again within this is a failure")  # fmt: skip
    p.add_argument("--startup-timeout-s", type=float, default=90,
                   help="a group not ready within this after launch counts as hung")  # fmt: skip
    p.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.script.is_file():
        parser.error(f"--script {args.script} is not a file; pass the training script to run")
    if args.correlated:
        args.kinds = _names(CORRELATED_KINDS)
    try:
        config = ScheduleConfig(
            num_groups=args.groups,
            nproc_per_group=args.nproc_per_group,
            num_steps=args.steps,
            num_faults=args.faults,
            seed=args.seed,
            kinds=parse_kinds(args.kinds),
            min_delay_s=args.min_delay_s,
            max_delay_s=args.max_delay_s,
            warmup_steps=args.warmup_steps,
            tail_steps=args.tail_steps,
        )
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s chaos %(message)s")
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    runner = Runner(args, out, make_schedule(config), Children(args, out))
    for i, f in enumerate(runner.schedule):
        logger.info("scheduled %d: %s", i, f)

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    # Explicitly: a shell script that starts us in the background leaves
    # SIGINT ignored, and `kill -INT` must still stop every child.
    signal.signal(signal.SIGINT, interrupted)
    try:
        runner.run()
    except KeyboardInterrupt:
        print("\ninterrupted; stopping every process")
        runner.children.kill_all()
        return 130
    except BaseException:
        runner.children.kill_all()
        raise
    left = runner.children.kill_all()
    return report(runner, left)


def _names(kinds: tuple[FaultKind, ...]) -> str:
    return ",".join(k.value for k in kinds)
