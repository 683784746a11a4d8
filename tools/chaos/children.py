"""The chaos runner's child processes: the lighthouse and each group's torchrun job.

Owns how they are started (the training script's command line and
environment), how a group is killed, and the final cleanup that kills every
process the run ever started and reports any that survived.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from tools.procs import kill_tree, signal_tree, spawn, tree

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SCRIPT = REPO / "examples" / "train_ddp.py"

SCRIPT_CONTRACT = """\
The training script (--script) runs under torchrun, one process per rank, as
  SCRIPT --steps N --stop-file PATH --hidden N --layers 2 --step-sleep S
         --timeout-s S --log-json PATH
with TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS,
TORCHFT_TIMEOUT_SEC, TORCHFT_QUORUM_TIMEOUT_SEC and TORCHFT_CONNECT_TIMEOUT_SEC
in its environment. It trains until its committed step reaches --steps or the
number the runner writes (atomically, once) into --stop-file, then exits 0.
Rank 0 appends one JSON object per line to --log-json:
  {"event": "start"}                                         at each start
  {"event": "step", "t": UNIX_S, "step": COMMITTED_STEP,
   "committed": BOOL, "participants": N}                     after each step
(examples/train_ddp.py also logs its batch: participating_rank, data_cursor,
data_unit, data_epoch, sample_ids, which the exactly-once data check reads)
  {"event": "final", "step": N, "hash": STR, "quorum_id": N} at the end
where hash digests the model and optimizer state (groups must agree on it).
Workers are found for kill_rank by the script's file name in their command
line and by RANK in their environment. The correlated kinds also read the
Manager's INFO lines from the group's output: kill_in_reconfigure strikes its
second group at "reconfiguring for quorum N: replica rank R of S" (else after
2 s), restart_lighthouse_in_heal at "healing from replica rank".

environment: the runner reads none itself; its lighthouse and groups
inherit it (e.g. TORCHFT_SECRET_FILE turns access control on for all), and
it sets the variables above for each group.

example:
  .venv/bin/python -m tools.chaos --groups 3 --faults 8 --kinds kill_group,stop_group --seed 1"""


@dataclass
class Group:
    """One replica group's torchrun job, and what the runner knows of it."""

    index: int
    log: Path
    proc: subprocess.Popen | None = None
    state: str = "running"
    """running, stopped (SIGSTOP), dead (waiting for restart_at), finished."""
    restart_at: float = 0.0
    launched_at: float = 0.0
    progress_at: float = 0.0
    """Last sign of life: launch, a log record, or the SIGCONT."""
    incarnation: int = -1
    started: bool = False
    """A start record arrived since the last launch (the Manager is up)."""
    offset: int = 0
    final: dict | None = None
    finished_at: float = 0.0


class Children:
    """Every process the run started, each in a session of its own."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args = args
        self.out = out
        self.script = Path(args.script).resolve()
        self.port = 0
        self.lighthouse: subprocess.Popen | None = None
        self.procs: list[subprocess.Popen] = []
        self.seen: dict[tuple[int, float], psutil.Process] = {}

    @property
    def stop_file(self) -> Path:
        """Where the runner writes the step every group stops at."""
        return self.out / "stop_step"

    def _spawn(self, argv: list[str], log_name: str, env: dict[str, str]) -> subprocess.Popen:
        with open(self.out / log_name, "ab") as log:  # the child keeps its own copy
            proc = spawn(argv, log, env, REPO)
        self.procs.append(proc)
        return proc

    def start_lighthouse(self, wait_s: float = 30) -> None:
        """Starts it on self.port; retries while the port is still held."""
        deadline = time.monotonic() + wait_s
        while True:
            self.lighthouse = self._spawn(
                [sys.executable, "-m", "lighthouse", "--min-replicas", "1",
                 "--bind", f"127.0.0.1:{self.port}", "--http-bind", "",
                 "--heartbeat-timeout-ms", str(self.args.heartbeat_timeout_ms),
                 "--join-timeout-ms", str(self.args.join_timeout_ms),
                 # As a supervisor runs it: a restart keeps the job's mark and last quorum.
                 "--state-file", str(self.out / "lighthouse-state.json")],
                "lighthouse.log", {},
            )  # fmt: skip
            while self.lighthouse.poll() is None and time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                    return
                except OSError:
                    time.sleep(0.05)
            kill_tree(self.lighthouse.pid)
            self.lighthouse.wait()
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"lighthouse did not start on port {self.port}; see lighthouse.log"
                )
            time.sleep(0.2)

    def lighthouse_down(self) -> bool:
        return self.lighthouse is None or self.lighthouse.poll() is not None

    def kill_lighthouse(self) -> None:
        assert self.lighthouse is not None
        kill_tree(self.lighthouse.pid)
        self.lighthouse.wait()

    def launch(self, group: Group) -> None:
        a = self.args
        group.proc = self._spawn(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node", str(a.nproc_per_group), "--max-restarts", str(a.max_restarts),
             # The runner ends training through --stop-file; --steps only caps it.
             str(self.script), "--steps", str(10 * a.steps + 1000),
             "--stop-file", str(self.stop_file), "--hidden", str(a.hidden),
             "--layers", "2", "--step-sleep", str(a.step_sleep), "--timeout-s", str(a.timeout_s),
             "--log-json", str(group.log),
             *(["--loader", a.loader] if a.loader else [])],
            self.text_log(group).name,
            {"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{self.port}",
             "REPLICA_GROUP_ID": str(group.index), "NUM_REPLICA_GROUPS": str(a.groups),
             "TORCHFT_TIMEOUT_SEC": str(a.timeout_s),
             "TORCHFT_QUORUM_TIMEOUT_SEC": str(a.quorum_timeout_s),
             "TORCHFT_CONNECT_TIMEOUT_SEC": str(a.timeout_s)},
        )  # fmt: skip
        group.state = "running"
        group.started = False
        group.launched_at = group.progress_at = time.time()

    def kill_group(self, group: Group) -> list[psutil.Process]:
        """SIGKILLs the group's tree; returns the processes that survived it."""
        return self.kill_groups([group])[0]

    def kill_groups(self, groups: list[Group]) -> list[list[psutil.Process]]:
        """SIGKILLs the groups' trees in one round, as a rack failing does,
        then waits for each; returns, per group, the processes that survived."""
        for group in groups:
            assert group.proc is not None
            signal_tree(group.proc.pid, signal.SIGKILL)
        survived = []
        for group in groups:
            assert group.proc is not None
            survived.append(kill_tree(group.proc.pid))  # again, and waits until gone
            group.proc.wait(timeout=10)
            group.state = "dead"
        return survived

    def text_log(self, group: Group) -> Path:
        """The group's torchrun output: every rank's log lines (the Manager's among them)."""
        return self.out / f"group{group.index}.log"

    def workers_of_rank(self, group: Group, rank: int) -> list[psutil.Process]:
        """The group's training processes of RANK `rank` (torchrun's are not)."""
        assert group.proc is not None
        return [p for p in tree(group.proc.pid) if self._rank_of(p) == rank]

    def _rank_of(self, proc: psutil.Process) -> int | None:
        try:
            if not any(self.script.name in part for part in proc.cmdline()):
                return None
            rank = proc.environ().get("RANK")
            return int(rank) if rank is not None else None
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            return None

    def track(self) -> None:
        """Remembers every descendant ever seen, to check each is gone at exit."""
        for proc in self.procs:
            if proc.poll() is None:
                for p in tree(proc.pid):
                    try:
                        self.seen.setdefault((p.pid, p.create_time()), p)
                    except psutil.NoSuchProcess:
                        pass

    def kill_all(self) -> list[str]:
        """SIGKILLs every child tree; returns those still running after it."""
        self.track()
        for proc in self.procs:
            kill_tree(proc.pid)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        left = []
        for p in self.seen.values():  # an orphan whose parent died first
            try:
                if p.is_running():  # psutil checks the pid was not reused
                    p.kill()
                    p.wait(timeout=5)
            except (psutil.NoSuchProcess, psutil.TimeoutExpired, ChildProcessError):
                pass
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{p.pid} {' '.join(p.cmdline()[:4])}")
            except psutil.NoSuchProcess:
                pass
        return left
