"""torchtitan's fault-tolerance trainer, its own code unpatched, on torchft_like
through `TORCHFT_LIKE_AS_TORCHFT=1`, beside the same job on pytorch/torchft:
two replica groups, one SIGKILLed mid-run and restarted, healing from its peer
and going on at its peer's step (opt-in: scripts/integration.sh).

Each mode runs on both implementations in one test, so the losses after the
heal are compared in one run on one machine."""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.procs import PYTHON, REPO, wait_for_line
from tests.waiting import wait_until
from tools.procs import kill_tree

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
pytest.importorskip("torchtitan", reason="torchtitan is not installed: run scripts/integration.sh")
pytest.importorskip("torchft.coordination", reason="torchft, the reference: scripts/integration.sh")

LAUNCH = REPO / "tests" / "clients" / "titan" / "launch.py"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+([\d.]+)")


@dataclass
class Mode:
    config: str
    ranks: int  # per replica group
    steps: int
    kill_at: int


MODES = {
    "replicas": Mode("ft_replicas", ranks=1, steps=40, kill_at=10),
    "hsdp": Mode("ft_hsdp", ranks=2, steps=30, kill_at=8),
    "local_sgd": Mode("ft_local_sgd", ranks=1, steps=40, kill_at=12),
    "diloco": Mode("ft_diloco", ranks=1, steps=40, kill_at=12),
}


@dataclass
class Run:
    logs: list[str]  # group 0, group 1 before the kill, group 1 restarted
    losses: list[dict[int, float]]  # per log: step -> loss
    wall_s: float


def start_lighthouse(children, impl: str) -> str:
    if impl == "torchft_like":
        args = ["-m", "lighthouse", "--min-replicas", "2", "--bind", "127.0.0.1:0",
                "--http-bind", "", "--join-timeout-ms", "1000"]  # fmt: skip
    else:
        args = ["-c", "import time; from torchft.coordination import LighthouseServer as L; "
                "s = L(bind='127.0.0.1:0', min_replicas=2, join_timeout_ms=1000); "
                "time.sleep(3600)"]  # fmt: skip
    proc = children.spawn([PYTHON, *args])
    return wait_for_line(proc, r"listening on:? (http://\S+)", timeout=30).group(1)


def start_group(children, impl: str, mode: Mode, lighthouse: str, group: int, log: Path):
    alias = "1" if impl == "torchft_like" else ""
    env = {"TORCHFT_LIGHTHOUSE": lighthouse, "TORCHFT_LIKE_AS_TORCHFT": alias}
    return children.spawn(
        [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         str(mode.ranks), str(LAUNCH), "--module", "configs", "--config", mode.config,
         "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(group),
         "--fault_tolerance.group_size", "2", "--fault_tolerance.min_replica_size", "2",
         "--training.steps", str(mode.steps), "--dump_folder", str(log.parent / f"dump{group}")],
        log=log, env=env,
    )  # fmt: skip


def read(log: Path) -> str:
    return ANSI.sub("", log.read_text(errors="replace")) if log.exists() else ""


def losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in STEP.findall(text)}


class JobFailed(AssertionError):
    def __init__(self, what: str, log: str) -> None:
        self.first_error = first_error(log)
        super().__init__(f"{what}: {self.first_error}\n{log[-6000:]}")


def run_job(children, tmp_path: Path, impl: str, mode: Mode, kill: bool = True) -> Run:
    out = tmp_path / f"{impl}{'' if kill else '-no-kill'}"
    out.mkdir()
    logs = [out / "group0.log", out / "group1.log", out / "group1-restarted.log"]
    start = time.monotonic()
    lighthouse = start_lighthouse(children, impl)
    survivor = start_group(children, impl, mode, lighthouse, 0, logs[0])
    second = start_group(children, impl, mode, lighthouse, 1, logs[1])
    deadline = time.monotonic() + 300

    def at_the_kill_step() -> bool:
        if max(losses(read(logs[1])), default=0) >= mode.kill_at:
            return True
        for proc, log in ((survivor, logs[0]), (second, logs[1])):
            if proc.poll() is not None:
                raise JobFailed(f"{impl} {log.name} ended early", read(log))
        return False

    if kill:
        wait_until(at_the_kill_step, 300, f"group 1 to reach step {mode.kill_at}")
        kill_tree(second.pid)
        second = start_group(children, impl, mode, lighthouse, 1, logs[2])
    for proc, log in ((survivor, logs[0]), (second, logs[2 if kill else 1])):
        rc = proc.wait(timeout=max(1, deadline + 300 - time.monotonic()))
        if rc != 0:
            raise JobFailed(f"{impl} {log.name} exited {rc}", read(log))
    texts = [read(log) for log in logs]
    return Run(texts, [losses(t) for t in texts], time.monotonic() - start)


def heal(text: str) -> tuple[int, float, float]:
    """Our Manager's own log lines: the step healed at, MB and seconds."""
    step = int(re.search(r"healed: loaded the live state at step (\d+)", text).group(1))
    mb, s = re.search(r"received step \d+ from \S+ ([\d.]+) MB in ([\d.]+) s", text).groups()
    return step, float(mb), float(s)


def tail_loss(run: Run, n: int = 5, behind: int = 0) -> float:
    """Mean loss of both groups' n steps ending `behind` steps before the last."""
    last = [run.losses[0], run.losses[2] or run.losses[1]]
    end = max(run.losses[0]) - behind
    return statistics.mean(v for group in last for s, v in group.items() if end - n < s <= end)


KILL_COSTS_STEPS = 5
"""How far (in steps of progress) a killed run may trail the same job run
without a kill. By design a kill costs the step that was running and the heal
step, which cannot commit with min_replica_size 2 (the healer does not count),
while torchtitan's linearly decaying learning rate steps on; the restarted
group also replays a step or two of its data. Seeded runs measured 2.5-4.5
steps behind at the end (the same deficit in loss is more steps where the
curve is flatter); a heal that went wrong stays near the initial loss."""


def first_error(text: str) -> str:
    """The first line of a failed job's log that names an error."""
    patterns = (r"\[rank\d+\]: \w+(Error|Exception): .*", r"terminate called.*", r"\w+Error: .*")
    for pattern in patterns:
        match = re.search(pattern, text)
        if match:
            return match.group(0)[:200]
    return "(no error line)"


@pytest.mark.parametrize("name", list(MODES))
def test_a_killed_group_heals_from_its_peer_and_trains_on(children, tmp_path, name):
    mode = MODES[name]
    ours = run_job(children, tmp_path, "torchft_like", mode)
    children.kill_all()
    try:
        reference, against = run_job(children, tmp_path, "torchft", mode), "torchft"
    except JobFailed as e:
        # pytorch/torchft cannot run this mode (torchtitan #4753 and the like):
        # compare with our own run of it without a kill.
        children.kill_all()
        print(f"\n{name}: pytorch/torchft failed: {e.first_error}")
        reference = run_job(children, tmp_path, "torchft_like", mode, kill=False)
        against = "torchft_like without a kill"

    text = ours.logs[2]
    assert "torchft_like.manager" in text, "torchft_like did not do the work"
    assert "torchft.manager" not in text.replace("torchft_like.manager", "")
    step, mb, seconds = heal(text)  # the Manager's step: one per sync in LocalSGD/DiLoCo
    resumed = int(STEP.search(text, text.index("healed: loaded")).group(1))
    assert resumed > mode.kill_at, "the restarted group did not go on at its peer's step"
    assert max(ours.losses[0]) == max(ours.losses[2]) == mode.steps
    ours_loss, ref_loss = tail_loss(ours), tail_loss(reference)
    print(
        f"\n{name}: healed at manager step {step}, went on at step {resumed}: "
        f"{mb:.1f} MB in {seconds:.2f} s; "
        f"loss over the last 5 steps: torchft_like {ours_loss:.4f}, {against} {ref_loss:.4f}; "
        f"job wall: torchft_like {ours.wall_s:.0f} s, reference {reference.wall_s:.0f} s"
    )
    if against == "torchft":  # both killed: the same cost
        assert abs(ours_loss - ref_loss) <= 0.1 * ref_loss + 0.05
    else:
        ours_10 = tail_loss(ours, 10)
        bound = tail_loss(reference, 10, behind=KILL_COSTS_STEPS)
        print(f"last 10 steps: {ours_10:.4f}; unkilled, {KILL_COSTS_STEPS} earlier: {bound:.4f}")
        assert ours_10 <= bound + 0.05
        assert ours_10 >= 0.9 * tail_loss(reference, 10) - 0.05
