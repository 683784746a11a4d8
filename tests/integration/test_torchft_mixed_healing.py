"""A job moving from pytorch/torchft to torchft_like one group at a time:
a torchft group and a torchft_like group, each of one rank in a thread,
heal from each other through our lighthouse (real gRPC, each side's own
ManagerServer and HTTP checkpoint transport) and end bit-identical.

The groups do not allreduce across the job: torchft's newest release
(2026.10.26, the bench extra's) forms its process groups from reconfigure
handles exchanged through the quorum, which torchft_like does not speak
yet, so each group runs on its own side's ProcessGroupDummy. Every group
trains on the same batch per step, so replicas with the same weights make
the same update, and the quorum is synchronous (a healing replica loads the
state before its forward pass and counts, torchft's rule). A cross-group
allreduce would keep a source from ending its step (and withdrawing its
state) before the healing replica has fetched; here the test holds it.
"""

from __future__ import annotations

import copy
import logging
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore

from lighthouse import LighthouseServer
from tests.waiting import wait_until
from torchft_like import Manager, ProcessGroupDummy

WHY = "pytorch/torchft is not installed (the bench extra installs it)"
torchft_manager = pytest.importorskip("torchft.manager", reason=WHY)
torchft_pg = pytest.importorskip("torchft.process_group", reason=WHY)

pytestmark = pytest.mark.timeout(90)
T = timedelta(seconds=10)
MAX_STEPS = 60
"""Bound on the steps of one group, so a step that never commits ends the test."""


class Group:
    """One replica group of one rank, training in a thread until told to stop."""

    def __init__(self, name: str, kind: str, lighthouse: str, seed: int, job: list[Group]) -> None:
        torch.manual_seed(seed)  # weights unlike the other groups': healing must copy them
        self.name, self.seed = name, seed
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        kwargs: dict[str, Any] = dict(
            load_state_dict=self.load,
            state_dict=self.state,
            min_replica_size=1,
            timeout=T,
            quorum_timeout=T,
            connect_timeout=T,
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=self.store.port,
            lighthouse_addr=lighthouse,
            replica_id=name,
            hostname="127.0.0.1",
            use_async_quorum=False,
        )
        if kind == "torchft":
            self.manager: Any = torchft_manager.Manager(
                pg=torchft_pg.ProcessGroupDummy(0, 1), **kwargs
            )
        else:
            self.manager = Manager(pg=ProcessGroupDummy(), exit_with_parent=False, **kwargs)
        self.committed: dict[int, Any] = {}
        """Step -> a copy of the state once that step is committed."""
        self.healed_to: int | None = None
        self.until: int | None = None
        self.stop = threading.Event()
        self.joined = threading.Event()
        """Set once the first quorum (and healing) of this group is done."""
        self.job = job
        job.append(self)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run, name=name, daemon=True)
        self.thread.start()

    def state(self) -> dict[str, Any]:
        return {"m": self.model.state_dict(), "o": self.opt.state_dict()}

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["m"])
        self.opt.load_state_dict(state["o"])

    def step(self) -> int:
        return int(self.manager.current_step())

    def run(self) -> None:
        try:
            for _ in range(MAX_STEPS):
                step = self.step()
                if self.stop.is_set() or (self.until is not None and step >= self.until):
                    return
                self.manager.start_quorum()
                self.joined.set()
                self.opt.zero_grad()
                now = self.step()  # healed: the step of the state loaded
                x = torch.linspace(-1, 1, 12).reshape(3, 4) * (1 + now % 3)
                self.model(x).square().sum().backward()
                works = [self.manager.allreduce(p.grad) for p in self.model.parameters()]
                for work in works:
                    work.wait()
                if self.manager.num_participants() > 1:  # a peer may be fetching our state
                    for other in self.job:
                        assert other.joined.wait(20), f"{other.name} never joined"
                if self.manager.should_commit():
                    self.opt.step()
                    if self.step() > step + 1 and self.healed_to is None:
                        self.healed_to = self.step() - 1
                    self.committed[self.step()] = copy.deepcopy(self.state())
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            self.manager.shutdown()

    def wait_for(self, what: str, condition: Any, timeout: float = 30.0) -> None:
        def met() -> bool:
            if condition():
                return True
            assert self.error is None, f"{self.name} failed: {self.error!r}"
            assert self.thread.is_alive(), f"{self.name} stopped before {what}"
            return False

        wait_until(met, timeout, f"{self.name}: {what}")

    def join(self) -> None:
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), f"{self.name} did not stop"
        assert self.error is None, f"{self.name} failed: {self.error!r}"


def assert_bit_identical(a: Any, b: Any, path: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_bit_identical(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_torchft_and_torchft_like_groups_heal_from_each_other_bit_identically(caplog):
    caplog.set_level(logging.DEBUG, logger="torchft_like.checkpointing.http_transport")
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=1000
    )
    groups: list[Group] = []
    try:
        address = lighthouse.address()
        # 1. A torchft job of one group trains; a torchft_like group joins and heals from it.
        old = Group("torchft_a", "torchft", address, seed=1, job=groups)
        old.wait_for("step 2", lambda: old.step() >= 2)
        new = Group("torchft_like_b", "torchft_like", address, seed=2, job=groups)
        new.wait_for("healing", lambda: new.healed_to is not None)
        new.wait_for("two steps after healing", lambda: new.step() >= new.healed_to + 2)
        old.stop.set()  # the torchft group leaves; the torchft_like group trains on alone
        old.join()
        last = max(old.committed)
        assert new.healed_to is not None and new.healed_to < last
        assert_bit_identical(old.committed[last], new.committed[last])

        # 2. A fresh torchft group joins the torchft_like one and heals from it.
        back = Group("torchft_c", "torchft", address, seed=3, job=groups)
        back.wait_for("healing", lambda: back.healed_to is not None)
        assert back.healed_to >= last  # from the torchft_like group: the only one left
        end = max(back.step(), new.step()) + 2
        back.until = new.until = end
        back.join()
        new.join()
        assert max(back.committed) == max(new.committed) == end
        assert_bit_identical(new.committed[end], back.committed[end])
        lines = [r.getMessage() for r in caplog.records]
        assert any("torchft's format" in line and "received step" in line for line in lines)
        assert any(f"GET /torchft_like/checkpoint/{back.healed_to}/full" in x for x in lines)
        trained = new.committed[end]["m"]["0.weight"]
        assert not torch.equal(trained, old.committed[last]["m"]["0.weight"])  # it did train on
    finally:
        for group in groups:
            group.stop.set()
        for group in groups:
            group.thread.join(timeout=30)
        lighthouse.shutdown()
