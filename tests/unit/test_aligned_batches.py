"""StepBatches over a stateful loader it cannot steer (a sampler of torch's): each
group's own shard, one batch per committed step, across misses, heals and restores."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from torchft_like.data import StepBatches

NUM_SAMPLES, BATCH, GROUPS = 40, 4, 2  # 5 batches per shard per epoch
DATASET = TensorDataset(torch.arange(NUM_SAMPLES))


class Steps:
    """The two Manager calls StepBatches makes, with the step set by the test."""

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.state: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}

    def current_step(self) -> int:
        return self.step

    def register_state_dict_fn(self, key, load_state_dict, state_dict) -> None:
        self.state[key] = (load_state_dict, state_dict)


def stateful_loader(group: int) -> Any:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    sampler = TorchSampler(DATASET, num_replicas=GROUPS, rank=group, seed=3)
    return stateful.StatefulDataLoader(DATASET, batch_size=BATCH, sampler=sampler, drop_last=True)


LOADERS = pytest.mark.parametrize("make_loader", [stateful_loader])


def ids(batch: Any) -> list[int]:
    return batch[0].tolist()


def expected(group: int, num_steps: int) -> list[list[int]]:
    """The shard's batches in order, epoch after epoch, as the sampler defines them."""
    sampler = TorchSampler(DATASET, num_replicas=GROUPS, rank=group, seed=3)
    out: list[list[int]] = []
    epoch = 0
    while len(out) < num_steps:
        sampler.set_epoch(epoch)
        order = list(sampler)
        out += [order[i : i + BATCH] for i in range(0, len(order) - BATCH + 1, BATCH)]
        epoch += 1
    return out[:num_steps]


@LOADERS
@pytest.mark.parametrize(
    "commits",
    [
        [True] * 12,  # over two epochs
        [True, False, False, True, True, False, True, True, True, True, True, True],
        [False, True] * 7,
    ],
)
def test_each_committed_step_trains_the_next_batch_and_a_missed_step_the_same_again(
    make_loader, commits
):
    steps = Steps()
    batches = StepBatches(steps, make_loader(1))
    trained = []
    for committed in commits:
        batch = ids(next(batches))
        if committed:
            trained.append(batch)
            steps.step += 1
    assert trained == expected(1, len(trained))


@LOADERS
@pytest.mark.parametrize("peer_step", [0, 3, 4, 5, 9])
def test_a_healed_group_goes_on_from_its_own_shard_at_the_peers_step(make_loader, peer_step):
    # The peer (group 0) serves its state mid-step, with its batch in flight.
    peer_steps = Steps()
    peer = StepBatches(peer_steps, make_loader(0))
    for _ in range(peer_step):
        next(peer)
        peer_steps.step += 1
    next(peer)
    served = peer_steps.state["data"][1]()

    # Group 1 restarted at step 0, ran one step on its own batch, then loaded
    # the peer's state and committed with it (the Manager did step += 1).
    steps = Steps()
    healer = StepBatches(steps, make_loader(1))
    next(healer)
    steps.state["data"][0](served)
    steps.step = peer_step + 1
    after = [ids(next(healer))]
    steps.step += 1
    after.append(ids(next(healer)))
    assert after == expected(1, peer_step + 3)[peer_step + 1 :]


@LOADERS
@pytest.mark.parametrize("saved_at", [1, 4, 5, 6])
def test_a_group_restored_from_a_state_saved_after_a_commit_goes_on_with_the_next_batch(
    make_loader, saved_at
):
    steps = Steps()
    batches = StepBatches(steps, make_loader(1))
    for _ in range(saved_at):
        next(batches)
        steps.step += 1
    saved = steps.state["data"][1]()
    assert saved["step"] == saved_at
    restored_steps = Steps(step=saved_at)
    restored = StepBatches(restored_steps, make_loader(1))
    restored_steps.state["data"][0](saved)
    assert ids(next(restored)) == expected(1, saved_at + 1)[saved_at]


@LOADERS
@pytest.mark.parametrize(
    ("step", "epoch", "batch"), [(0, 0, 0), (4, 0, 4), (5, 1, 0), (7, 1, 2), (10, 2, 0)]
)
def test_the_position_names_the_epoch_and_batch_of_the_step(make_loader, step, epoch, batch):
    steps = Steps()
    batches = StepBatches(steps, make_loader(0))
    for _ in range(step):
        next(batches)
        steps.step += 1
    next(batches)
    position = batches.position()
    assert (position.step, position.epoch, position.batch) == (step, epoch, batch)


def test_a_loader_that_cannot_be_positioned_is_refused_with_the_fix():
    loader = DataLoader(DATASET, batch_size=BATCH, sampler=RandomSampler(DATASET))
    with pytest.raises(ValueError, match="StatefulDataLoader.*DistributedSampler"):
        StepBatches(Steps(), loader)


def test_a_step_that_goes_back_is_an_error():
    steps = Steps(step=3)
    batches = StepBatches(steps, stateful_loader(0))
    next(batches)
    steps.step = 2
    with pytest.raises(RuntimeError, match="went back from 4 to 2"):
        next(batches)
