"""Durable checkpoints on a real disk with real DCP: round trip, atomicity
(a crash mid-write leaves the previous checkpoint usable), retention, and
one writer per step."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from torchft_like.checkpointing import durable_layout as layout
from torchft_like.checkpointing.durable import DurableCheckpointer, load_state, save_state


class Trainer:
    """A model, an AdamW and a step: the four Manager calls the checkpointer makes."""

    def __init__(self, seed: int, participating_rank: int | None = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(8, 4)
        self.optim = torch.optim.AdamW(self.model.parameters())
        self.step = 0
        self.rank = participating_rank

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.optim.zero_grad()
            data = torch.randn(3, 8, generator=torch.Generator().manual_seed(self.step))
            self.model(data).pow(2).sum().backward()
            self.optim.step()
            self.step += 1

    def current_step(self) -> int:
        return self.step

    def participating_rank(self) -> int | None:
        return self.rank

    def full_state_dict(self) -> dict[str, Any]:
        return {
            "user": {
                "default": {"model": self.model.state_dict(), "optim": self.optim.state_dict()},
                "data": {"step": self.step, "epoch": 0, "batch": self.step, "loader": None},
            },
            "torchft": {"step": self.step, "batches_committed": 2 * self.step},
        }

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["user"]["default"]["model"])
        self.optim.load_state_dict(state["user"]["default"]["optim"])
        self.step = state["torchft"]["step"]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def test_a_saved_state_loads_back_with_every_key_type_and_bit(tmp_path):
    trainer = Trainer(seed=0)
    trainer.train(3)
    state = trainer.full_state_dict()
    state["user"]["default"]["model"] = dict(trainer.model.state_dict())
    save_state(state, tmp_path / "c")
    loaded = load_state(tmp_path / "c")
    assert same(state, loaded)
    assert 0 in loaded["user"]["default"]["optim"]["state"]  # integer keys stay integers


def test_resuming_continues_bit_identically_to_an_uninterrupted_run(tmp_path):
    reference = Trainer(seed=0)
    reference.train(7)

    first = Trainer(seed=0)
    saver = DurableCheckpointer(first, tmp_path, every_steps=5, group_rank=0, group_world_size=1)
    for _ in range(6):
        first.train(1)
        saver.maybe_save()
    saver.close()
    resumed = Trainer(seed=1)  # other weights: the checkpoint must replace them
    loader = DurableCheckpointer(resumed, tmp_path, every_steps=5, group_rank=0, group_world_size=1)
    assert loader.load_newest() == 5
    resumed.train(2)
    assert same(resumed.full_state_dict(), reference.full_state_dict())


def test_a_crash_mid_write_leaves_the_previous_checkpoint_the_newest(tmp_path):
    trainer = Trainer(seed=0)
    saver = DurableCheckpointer(trainer, tmp_path, every_steps=2, group_rank=0, group_world_size=1)
    trainer.train(2)
    assert saver.maybe_save()
    saver.close()
    expected = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    # What a SIGKILL mid-write leaves: a temporary directory, and a step
    # directory whose part lacks the marker (e.g. a rename by hand).
    (tmp_path / f"{layout.TMP_PREFIX}step_000000004-r0-dead").mkdir()
    (tmp_path / "step_000000004" / "rank_0").mkdir(parents=True)
    (tmp_path / "step_000000004" / "rank_0" / ".metadata").write_bytes(b"cut")
    fresh = Trainer(seed=5)
    assert (
        DurableCheckpointer(fresh, tmp_path, 2, group_rank=0, group_world_size=1).load_newest() == 2
    )
    assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in expected.items())


def test_only_the_newest_keep_checkpoints_stay(tmp_path):
    trainer = Trainer(seed=0)
    saver = DurableCheckpointer(trainer, tmp_path, every_steps=1, keep=2, group_rank=0,
                                group_world_size=1)  # fmt: skip
    for _ in range(5):
        trainer.train(1)
        saver.maybe_save()
    saver.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000004", "step_000000005"]
    assert os.listdir(tmp_path / "step_000000005" / "rank_0").count(layout.COMPLETE) == 1


def test_only_the_replica_with_participating_rank_0_writes(tmp_path):
    writer, other = Trainer(seed=0, participating_rank=0), Trainer(seed=0, participating_rank=1)
    healing = Trainer(seed=0, participating_rank=None)
    savers = [DurableCheckpointer(t, tmp_path, every_steps=1, group_rank=0, group_world_size=1)
              for t in (writer, other, healing)]  # fmt: skip
    for t, saver in zip((writer, other, healing), savers):
        t.train(1)
        assert saver.maybe_save() == (t is writer)
        saver.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000001"]


def test_a_step_with_a_part_missing_is_not_resumed_from(tmp_path):
    trainer = Trainer(seed=0)
    rank0 = DurableCheckpointer(trainer, tmp_path, every_steps=1, group_rank=0, group_world_size=2)
    trainer.train(1)
    rank0.maybe_save()
    rank0.close()
    assert rank0.newest_step() is None  # rank 1 never wrote its part
    assert rank0.load_newest() is None


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"every_steps \(0\) must be at least 1"):
        DurableCheckpointer(Trainer(0), tmp_path, every_steps=0)
