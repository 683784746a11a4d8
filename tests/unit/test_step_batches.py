"""StepBatches over torchft_like.DistributedSampler: every sample of every epoch
trained in exactly one committed step, through failed steps, deaths, restarts,
joins and whole-job restarts.

A simulated job, no sockets and no clock: each round, every live group takes
its batches from a real StepBatches over a real DataLoader, the quorum and
each replica's view of it come from the library's pure rules
(lighthouse.core.views, torchft_like.manager.heal_plan), and a group
commits unless the test fails its step.
The committed history (the units each committed step trained) travels with
the state, as the Manager's does, so the final replica's history is the
model's.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lighthouse.core.member_data import group_data
from lighthouse.core.quorum import Quorum, QuorumMember
from lighthouse.core.views import QuorumResult, compute_quorum_result
from torchft_like.data import BatchSlot, DistributedSampler, StepBatches, slot_forecast
from torchft_like.manager.heal_plan import participation

NUM_SAMPLES, BATCH = 96, 4


@dataclass
class Progress:
    """What healing copies: the Manager's progress and the trained history."""

    step: int = 0
    batches_committed: int = 0
    history: list[list[tuple[int, tuple[int, ...]]]] = field(default_factory=list)
    """Per committed step: (unit, sample ids of one rank) of every participant's every rank."""


class SimManager:
    """The Manager calls StepBatches makes, over a Progress the job drives."""

    def __init__(self) -> None:
        self.progress = Progress()
        self.forecast = BatchSlot(slot=-1, participants=1)
        self.claimed: int | None = None

    def current_step(self) -> int:
        return self.progress.step

    def batches_committed(self) -> int:
        return self.progress.batches_committed

    def claim_batch_slot(self) -> BatchSlot:
        self.claimed = self.forecast.slot
        return self.forecast

    def register_state_dict_fn(self, key: str, load: Callable[..., None], save: Callable) -> None:
        raise AssertionError("a steered StepBatches registers no state")


def plain_loader(group_rank: int, ranks: int) -> Any:
    dataset = TensorDataset(torch.arange(NUM_SAMPLES))
    sampler = DistributedSampler(dataset, 0, 1, group_rank=group_rank, num_replicas=ranks, seed=7)
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler)


def stateful_loader(group_rank: int, ranks: int) -> Any:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    dataset = TensorDataset(torch.arange(NUM_SAMPLES))
    sampler = DistributedSampler(dataset, 0, 1, group_rank=group_rank, num_replicas=ranks, seed=7)
    return stateful.StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler)


class Group:
    def __init__(self, name: str, incarnation: int, ranks: int, make_loader: Callable) -> None:
        self.replica_id = f"{name}:{incarnation}"
        self.manager = SimManager()
        self.ranks = [StepBatches(self.manager, make_loader(r, ranks)) for r in range(ranks)]


class Job:
    def __init__(self, groups: int, ranks: int, make_loader: Callable) -> None:
        self.ranks, self.make_loader = ranks, make_loader
        self.live: dict[str, Group] = {}
        self.incarnations: dict[str, int] = {}
        self.quorum_id = 0
        self.wasted = 0
        for g in range(groups):
            self.start(f"g{g}")

    def start(self, name: str, progress: Progress | None = None) -> None:
        self.incarnations[name] = self.incarnations.get(name, -1) + 1
        group = Group(name, self.incarnations[name], self.ranks, self.make_loader)
        if progress is not None:  # restored from a durable checkpoint
            group.manager.progress = progress
        self.live[name] = group

    def round(self, fail: frozenset[str] = frozenset(), die: frozenset[str] = frozenset()) -> None:
        """One step: every live group takes its batches and asks for a quorum;
        groups in `die` die inside the step's allreduce (so no one's
        completes); groups in `fail` vote no."""
        taken: dict[str, list[tuple[Any, Any]]] = {}
        for name, g in self.live.items():
            taken[name] = [(b.position(), batch) for b in g.ranks for batch in [next(b)]]
        members = tuple(
            QuorumMember(
                replica_id=g.replica_id,
                address="",
                store_address="",
                step=g.manager.progress.step,
                world_size=self.ranks,
                data=group_data(
                    step=g.manager.progress.step,
                    fingerprints={},
                    world_size=self.ranks,
                    batch_slot=g.manager.claimed,
                ),
            )  # fmt: skip
            for g in self.live.values()
        )
        self.quorum_id += 1
        quorum = Quorum(self.quorum_id, tuple(sorted(members, key=lambda m: m.replica_id)), 0.0)
        results: dict[str, QuorumResult] = {
            n: compute_quorum_result(quorum, g.replica_id, 0, init_sync=True)
            for n, g in self.live.items()
        }
        before = {n: g.manager.progress for n, g in self.live.items()}
        count = next(iter(results.values())).max_world_size
        participants: list[tuple[int, str]] = []
        wrong = next(iter(results.values())).batch_slots_wrong
        for n, r in results.items():
            count, rank = participation(r, every_member_counts=False, max_participants=None)
            committed = not (wrong or die or n in fail)
            self.live[n].manager.forecast = slot_forecast(r, None, committed, (count, rank))
            if rank is not None:
                participants.append((rank, n))
        if wrong or die:
            self.wasted += 1
        trained: list[tuple[int, tuple[int, ...]]] = []
        for rank, n in sorted(participants):
            for position, batch in taken[n]:
                if not wrong:  # a committed step trains the quorum's units
                    assert position.unit == before[n].batches_committed + rank
                trained.append((position.unit, tuple(batch[0].tolist())))
        for n in die:
            del self.live[n]
        if wrong or die:
            return
        sources = [before[n] for _, n in sorted(participants)]
        assert all(s == sources[0] for s in sources), "participants at different states"
        for n, r in results.items():
            if n in fail:
                continue
            state = sources[0] if r.heal else before[n]
            self.live[n].manager.progress = Progress(
                step=state.step + 1,
                batches_committed=state.batches_committed + count,
                history=[*state.history, trained],
            )

    def final_history(self) -> list[list[tuple[int, tuple[int, ...]]]]:
        return max((g.manager.progress for g in self.live.values()), key=lambda p: p.step).history


def check_exactly_once(history: list[list[tuple[int, tuple[int, ...]]]], ranks: int) -> int:
    """Every sample of each whole epoch trained once, none twice in the last;
    returns the epochs covered whole."""
    units_per_epoch = NUM_SAMPLES // (BATCH * ranks)
    by_epoch: dict[int, list[int]] = {}
    units = sorted(u for step in history for u, _ in step)
    for step in history:
        for unit, ids in step:
            by_epoch.setdefault(unit // units_per_epoch, []).extend(ids)
    # Every unit below the cursor trained, by `ranks` ranks each.
    assert units == sorted(u for u in range(len(units) // ranks) for _ in range(ranks))
    whole = 0
    for epoch, ids in sorted(by_epoch.items()):
        assert len(ids) == len(set(ids)), f"a sample trained twice in epoch {epoch}"
        if len(ids) == units_per_epoch * BATCH * ranks:
            assert sorted(ids) == list(range(NUM_SAMPLES))
            whole += 1
    return whole


LOADERS = pytest.mark.parametrize("make_loader", [plain_loader, stateful_loader])


@LOADERS
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize(
    "events",
    [
        {},
        {5: "fail g1"},
        {5: "fail g0 g1 g2"},
        {4: "die g1", 7: "start g1"},
        {4: "die g0", 5: "die g2", 9: "start g0", 10: "start g2"},
        {6: "leave g2", 12: "start g2"},
        {3: "fail g2", 4: "die g0", 5: "start g0", 6: "fail g0"},
        {8: "start g3"},
    ],
    ids=["no-fault", "one-fails", "all-fail", "die-restart", "two-die", "leave", "mixed", "join"],
)
def test_every_sample_of_each_epoch_is_trained_once(make_loader, ranks, events):
    job = Job(3, ranks, make_loader)
    for i in range(40):
        what, *names = events.get(i, "none").split()
        if what == "start":
            for n in names:
                job.start(n)
        elif what == "leave":  # dies between steps: not in the quorum
            for n in names:
                del job.live[n]
        job.round(
            fail=frozenset(names) if what == "fail" else frozenset(),
            die=frozenset(names) if what == "die" else frozenset(),
        )
    assert check_exactly_once(job.final_history(), ranks) >= 2


@pytest.mark.parametrize("seed", range(8))
def test_random_faults_never_lose_or_repeat_a_sample(seed):
    rng = random.Random(seed)
    job = Job(3, 1, plain_loader)
    for _ in range(120):
        dead = sorted({"g0", "g1", "g2", "g3"} - job.live.keys())
        if dead and rng.random() < 0.3:
            job.start(rng.choice(dead))
        roll, names = rng.random(), sorted(job.live)
        if roll < 0.1 and len(names) > 1:
            job.round(die=frozenset([rng.choice(names)]))
        elif roll < 0.25:
            job.round(fail=frozenset(rng.sample(names, rng.randint(1, len(names)))))
        else:
            job.round()
    assert check_exactly_once(job.final_history(), 1) >= 2


def test_a_fresh_job_loses_one_step_to_its_first_quorum_and_none_after():
    job = Job(3, 1, plain_loader)
    for _ in range(10):
        job.round()
    assert job.wasted == 1
    assert len(job.final_history()) == 9


def test_a_whole_job_restart_resumes_at_the_first_unit_not_committed():
    job = Job(3, 2, plain_loader)
    for _ in range(12):
        job.round()
    progress = max((g.manager.progress for g in job.live.values()), key=lambda p: p.step)
    job.live.clear()
    for n in ("g0", "g1", "g2"):
        job.start(n, Progress(progress.step, progress.batches_committed, list(progress.history)))
    for _ in range(20):
        job.round()
    assert check_exactly_once(job.final_history(), 2) >= 2


def test_a_data_set_smaller_than_one_group_batch_is_refused():
    dataset = TensorDataset(torch.arange(6))
    sampler = DistributedSampler(dataset, 0, 1, group_rank=0, num_replicas=2)
    with pytest.raises(ValueError, match=r"smaller than one replica group's batch.*4 per rank"):
        StepBatches(SimManager(), DataLoader(dataset, batch_size=4, sampler=sampler))
