"""A pytorch/torchft nightly group and a torchft_like group asked to share a
real allreduce (each on its side's ProcessGroupGloo) cannot: the nightly
rendezvouses through reconfigure handles carried in the quorum, we through
the store. The job must not stall: our lighthouse refuses one side at
quorum time with an error naming both versions, and the other trains on
(lighthouse.core.compat's rule; docs/differences.md).

A refused torchft_like group raises IncompatibleGroupError at once. A
refused torchft group's ManagerServer (Rust) logs our error ("lighthouse
quorum failed. error: status: FailedPrecondition, message: ...") but does
not hand it to its ranks: they raise torchft's own timeout at their
quorum_timeout, which these tests set to the heartbeat timeout.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from lighthouse import IncompatibleGroupError, LighthouseServer
from tests.integration._one_rank import manager_kwargs
from tests.waiting import wait_until
from torchft_like import Manager, ProcessGroupGloo

WHY = "pytorch/torchft is not installed (the bench extra installs it)"
torchft_manager = pytest.importorskip("torchft.manager", reason=WHY)
torchft_pg = pytest.importorskip("torchft.process_group", reason=WHY)

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=10)
HEARTBEAT_TIMEOUT_MS = 3000
TORCHFT_QUORUM_TIMEOUT = timedelta(milliseconds=HEARTBEAT_TIMEOUT_MS)
STEPS = 4


class Group(threading.Thread):
    """One replica group of one rank: `steps` committed steps (or until
    `stop`), or the error that stopped it, and how long it took to get it."""

    def __init__(
        self,
        kind: str,
        lighthouse: str,
        steps: int = STEPS,
        torchft_quorum_timeout: timedelta = TORCHFT_QUORUM_TIMEOUT,
    ) -> None:
        super().__init__(name=kind, daemon=True)
        self.kind, self.lighthouse, self.steps = kind, lighthouse, steps
        self.torchft_quorum_timeout = torchft_quorum_timeout
        self.stop = threading.Event()
        self.ready = threading.Event()
        """Set once the Manager exists (it has heartbeated), or could not be built."""
        self.committed: list[float] = []
        self.error: BaseException | None = None
        self.error_after_s: float | None = None
        self.start()

    def run(self) -> None:
        try:
            manager = self._manager()
        finally:
            self.ready.set()
        if manager is None:
            return
        start = time.monotonic()
        try:
            for _ in range(2 * self.steps):  # bounded: a step that cannot commit ends the test
                if len(self.committed) == self.steps or self.stop.is_set():
                    break
                time.sleep(0.01)  # a long-running group leaves the other CPU time
                manager.start_quorum()
                t = torch.tensor([1.0])
                manager.allreduce(t).wait()
                if manager.should_commit():
                    self.committed.append(t.item())
        except BaseException as e:  # reported by the test
            self.error, self.error_after_s = e, time.monotonic() - start
        finally:
            manager.shutdown()

    def _manager(self) -> Any:
        # Kept as long as the group: the process group's store lives in it.
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        kwargs = manager_kwargs(f"{self.kind}_group", self.lighthouse, self.store, 1, T)
        if self.kind != "torchft":
            return Manager(pg=ProcessGroupGloo(timeout=T), exit_with_parent=False, **kwargs)
        if not hasattr(torchft_pg.ProcessGroup, "get_reconfigure_handle"):
            self.error = RuntimeError("skip: this torchft has no reconfigure handles")
            return None
        kwargs["quorum_timeout"] = self.torchft_quorum_timeout
        return torchft_manager.Manager(pg=torchft_pg.ProcessGroupGloo(timeout=T), **kwargs)


def our_lighthouse() -> LighthouseServer:
    return LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=500,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )


def started_together(lighthouse: Any) -> tuple[Group, Group]:
    """A torchft_like group and a torchft group started at once; both ended.
    Ours heartbeats before theirs starts: a lighthouse that heard only of
    theirs would issue it a quorum of one at once (torchft's does)."""
    try:
        ours = Group("torchft_like", lighthouse.address())
        assert ours.ready.wait(30), "the torchft_like group's Manager did not start"
        theirs = Group("torchft", lighthouse.address())
        ours.join(timeout=40)
        theirs.join(timeout=40)
    finally:
        lighthouse.shutdown()
    return ours, theirs


def test_a_torchft_nightly_group_is_refused_and_the_torchft_like_group_trains(capfd):
    ours, theirs = started_together(our_lighthouse())
    if isinstance(theirs.error, RuntimeError) and str(theirs.error).startswith("skip:"):
        pytest.skip(str(theirs.error))
    assert ours.error is None, f"torchft_like group failed: {ours.error!r}"
    assert ours.committed == [1.0] * STEPS  # alone: the torchft group never joined it
    assert theirs.error is not None and not theirs.committed
    assert theirs.error_after_s is not None
    assert theirs.error_after_s < HEARTBEAT_TIMEOUT_MS / 1000 + 1.5  # its quorum_timeout
    # Our error, as torchft's ManagerServer logs it (its ranks get a timeout).
    log = capfd.readouterr().err
    refused = [line for line in log.splitlines() if "FailedPrecondition" in line]
    assert refused, log[-3000:]
    assert "speaks torchft's reconfigure-handle rendezvous (pytorch/torchft nightly" in refused[0]
    assert "use store rendezvous (torchft_like 0.1.0" in refused[0]
    assert "torchft_like_group" in refused[0]  # the groups it was refused for


def joining_a_training_torchft_job(lighthouse: Any) -> tuple[Group, Group, int]:
    """A torchft group trains; a torchft_like group joins. Returns both and
    how many steps the torchft group had committed when ours stopped."""
    try:
        # torchft's lighthouse forgets our stopped group only when its
        # heartbeats lapse: the torchft quorum must outlast that, under load too.
        theirs = Group("torchft", lighthouse.address(), 1000, 3 * TORCHFT_QUORUM_TIMEOUT)
        # A group that stopped is waited for no longer: the test reports its error.
        wait_until(
            lambda: len(theirs.committed) >= 2 or not theirs.is_alive(),
            20,
            "the torchft group to commit 2 steps",
        )
        ours = Group("torchft_like", lighthouse.address())
        ours.join(timeout=40)
        at_refusal = len(theirs.committed)
        wait_until(
            lambda: len(theirs.committed) >= at_refusal + STEPS or not theirs.is_alive(),
            5 * HEARTBEAT_TIMEOUT_MS / 1000,
            f"the torchft group to commit {STEPS} more steps",
        )
        theirs.stop.set()
        theirs.join(timeout=40)
    finally:
        lighthouse.shutdown()
    return ours, theirs, at_refusal


def test_a_torchft_like_group_joining_a_training_torchft_job_is_refused():
    """The side that holds the quorum keeps it, whichever it is."""
    ours, theirs, at_refusal = joining_a_training_torchft_job(our_lighthouse())
    assert isinstance(ours.error, IncompatibleGroupError), repr(ours.error)
    assert "speaks store rendezvous (torchft_like 0.1.0" in str(ours.error)
    assert "use torchft's reconfigure-handle rendezvous" in str(ours.error)
    assert ours.error_after_s is not None
    assert ours.error_after_s < HEARTBEAT_TIMEOUT_MS / 1000
    assert theirs.error is None, f"torchft group failed: {theirs.error!r}"
    assert len(theirs.committed) >= at_refusal + STEPS  # it trained on


def rust_lighthouse(join_timeout_ms: int = 500) -> Any:
    from torchft._torchft import LighthouseServer as TorchftLighthouse

    return TorchftLighthouse(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )


def test_under_torchfts_lighthouse_a_torchft_like_group_joining_a_torchft_job_stops():
    """torchft's lighthouse mixes the two; our ManagerServer applies the rule:
    the side already training (the furthest step) keeps the job."""
    ours, theirs, at_refusal = joining_a_training_torchft_job(rust_lighthouse())
    assert isinstance(ours.error, IncompatibleGroupError), repr(ours.error)
    assert "speaks store rendezvous (torchft_like 0.1.0" in str(ours.error)
    assert ours.error_after_s is not None
    assert ours.error_after_s < HEARTBEAT_TIMEOUT_MS / 1000
    assert theirs.error is None, f"torchft group failed: {theirs.error!r}"
    assert len(theirs.committed) >= at_refusal + STEPS  # it trained on once ours stopped


def test_under_torchfts_lighthouse_torchft_like_groups_leave_torchft_ones_out():
    """Started together (a tie: store is kept), our group trains, leaving the
    torchft member out of its view. What the torchft group then does is
    torchft's own affair (it may train alone or fail in its configure), so
    only ours is asserted."""
    # A join timeout long enough for both to ask under load: in 500 ms the
    # torchft group once got a quorum alone and trained, and ours was then
    # rightly left out as the newcomer (a CI run on a loaded machine).
    ours, theirs = started_together(rust_lighthouse(join_timeout_ms=HEARTBEAT_TIMEOUT_MS))
    assert ours.error is None, f"torchft_like group failed: {ours.error!r}"
    assert ours.committed == [1.0] * STEPS
