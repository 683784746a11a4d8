"""Two deaths close together: what the survivor pays when a second group
dies while it reconfigures for the quorum that dropped the first.

    python -m bench.double_kill [--delays-ms 0 20 ... 200] [--modes worker group]
    python -m bench.double_kill --smoke       # one case

Three groups of two ranks (examples/train_ddp.py under torchrun, a 30 s
collective timeout as users set, the lighthouse's 1 s heartbeat timeout).
The first death is group 1's rank-0 worker (`worker`; torchrun ends the
other) or its whole tree (`group`). As soon as the lighthouse logs the
quorum that dropped group 1, the bench waits the delay and SIGKILLs group
2's whole tree: the second death lands while the survivor configures its
process group for that quorum. Reported per case: the survivor's longest
gap between commits from its last before the first death to its tenth
after the second; then both groups restart, heal from the survivor, and
the bench checks that the replicas end bit-identical.
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from bench._report import REPO, add_common_args, report, results_file
from tools.procs import kill_tree, read_jsonl, signal_tree, spawn, tree

PYTHON = sys.executable
GROUPS, NPROC = 3, 2
TIMEOUT_S = 30.0
HEARTBEAT_TIMEOUT_MS = 1000
STALLED_S = 150.0
"""A survivor with no 10 commits this long after the second death is
reported as stalled past it (a lower bound), and the case ends there."""
_ISSUED = re.compile(r"quorum (\d+) issued \([^)]*\): (.*)")


class _Lines:
    """A child's output lines, each with when it was read."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            self.lines.put((time.monotonic(), raw.decode(errors="replace")))

    def wait(self, pattern: re.Pattern[str], timeout: float) -> tuple[float, re.Match[str]]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line matching {pattern.pattern!r} in {timeout} s")
            try:
                at, line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            match = pattern.search(line)
            if match:
                return at, match


def _commits(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [r for r in read_jsonl(path) if r["event"] == "step" and r["committed"]]


def _wait(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def _rank0_worker(torchrun: subprocess.Popen) -> psutil.Process:
    for proc in tree(torchrun.pid)[1:]:
        try:
            if proc.environ().get("RANK") == "0" and "train_ddp" in " ".join(proc.cmdline()):
                return proc
        except psutil.Error:
            continue
    raise RuntimeError("torchrun has no rank-0 worker")


def run_case(out: Path, mode: str, delay_s: float, procs: list[subprocess.Popen]) -> dict:
    """One case in `out`; every process started is appended to `procs` (the
    caller kills them all). Returns its row."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    lighthouse = spawn(
        [PYTHON, "-m", "lighthouse", "--min-replicas", "1", "--bind", "127.0.0.1:0",
         "--http-bind", "", "--heartbeat-timeout-ms", str(HEARTBEAT_TIMEOUT_MS)],
        subprocess.PIPE, None, REPO,
    )  # fmt: skip
    procs.append(lighthouse)
    lines = _Lines(lighthouse)
    address = lines.wait(re.compile(r"listening on (http://\S+)"), 30)[1].group(1)

    def start(group: int) -> subprocess.Popen:
        proc = spawn(
            [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
             str(NPROC), "examples/train_ddp.py", "--steps", "100000", "--hidden", "64",
             "--timeout-s", str(TIMEOUT_S), "--step-sleep", "0.05",
             "--stop-file", str(out / f"group{group}.stop"),
             "--log-json", str(out / f"group{group}.jsonl")],
            open(out / f"group{group}.log", "ab"),
            {"TORCHFT_LIGHTHOUSE": address, "REPLICA_GROUP_ID": str(group),
             "NUM_REPLICA_GROUPS": str(GROUPS)},
            REPO,
        )  # fmt: skip
        procs.append(proc)
        return proc

    groups = [start(g) for g in range(GROUPS)]
    logs = [out / f"group{g}.jsonl" for g in range(GROUPS)]
    _wait(
        lambda: all(sum(r["participants"] == GROUPS for r in _commits(log)) >= 5 for log in logs),
        240,
        "5 steps committed by every group together",
    )
    while not lines.lines.empty():  # what the lighthouse said before the first death
        lines.lines.get_nowait()
    first_at = time.time()
    if mode == "worker":
        _rank0_worker(groups[1]).send_signal(signal.SIGKILL)
    else:
        signal_tree(groups[1].pid)
    # The quorum that dropped group 1: groups 0 and 2, without 1.
    while True:
        issued_at, match = lines.wait(_ISSUED, 60)
        members = {m.split(":", 1)[0].rsplit("_", 1)[-1] for m in match.group(2).split(", ")}
        if members == {"0", "2"}:
            break
    time.sleep(max(0.0, delay_s - (time.monotonic() - issued_at)))
    second_after_ms = (time.monotonic() - issued_at) * 1000
    signal_tree(groups[2].pid)
    second_at = time.time()
    kill_tree(groups[1].pid)
    kill_tree(groups[2].pid)
    # The stall: the survivor's longest gap from its last commit before the
    # first death to its 10th after the second (alone by then).
    try:
        _wait(
            lambda: sum(r["t"] > second_at for r in _commits(logs[0])) >= 10,
            STALLED_S,
            "the survivor to commit 10 steps after the second death",
        )
    except TimeoutError:  # stalled for good (the code before issue 37): a lower bound
        last = max(r["t"] for r in _commits(logs[0]))
        return {
            "mode": mode,
            "delay_ms": round(delay_s * 1000),
            "second_kill_after_issue_ms": round(second_after_ms),
            "survivor_stall_s": f">{time.time() - last:.0f}",
            "identical": None,
        }
    times = [r["t"] for r in _commits(logs[0])]
    window = [t for t in times if t <= first_at][-1:] + [t for t in times if t > first_at]
    window = window[: window.index(next(t for t in window if t > second_at)) + 10]
    stall_s = max(b - a for a, b in zip(window, window[1:]))
    # Both come back and heal from the survivor: the job ends bit-identical.
    restarted_at = time.time()
    groups[1], groups[2] = start(1), start(2)
    _wait(
        lambda: all(any(r["t"] > restarted_at for r in _commits(logs[g])) for g in (1, 2)),
        180,
        "both restarted groups to commit",
    )
    final = max(r["step"] for r in _commits(logs[0])) + 10
    for g in range(GROUPS):
        (out / "stop.tmp").write_text(str(final))
        (out / "stop.tmp").rename(out / f"group{g}.stop")
    for proc in groups:
        proc.wait(timeout=120)
    ends = {
        (r["step"], r["hash"]) for log in logs for r in read_jsonl(log) if r["event"] == "final"
    }
    return {
        "mode": mode,
        "delay_ms": round(delay_s * 1000),
        "second_kill_after_issue_ms": round(second_after_ms),
        "survivor_stall_s": round(stall_s, 3),
        "identical": len(ends) == 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--delays-ms", type=int, nargs="+", default=list(range(0, 201, 20)))
    parser.add_argument("--modes", nargs="+", default=["worker", "group"],
                        choices=["worker", "group"])  # fmt: skip
    parser.add_argument("--json", help="also write the rows to this file, one JSON array")
    add_common_args(parser)
    args = parser.parse_args()
    cases = [("worker", 0.06)] if args.smoke else [
        (mode, ms / 1000) for mode in args.modes for ms in args.delays_ms
    ]  # fmt: skip
    rows = []
    work = Path(args.out) / "double_kill"
    for mode, delay_s in cases:
        procs: list[subprocess.Popen] = []
        try:
            row = run_case(work / f"{mode}_{round(delay_s * 1000)}", mode, delay_s, procs)
        finally:
            for proc in procs:
                kill_tree(proc.pid)
        print(json.dumps(row), flush=True)
        rows.append(row)
    report(rows, results_file(args.out, "double_kill"))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
