"""Exactly-once data: the batch of each committed step, with its position as state.

The training loop's place in its data shard is part of the committed state:
the batch a step trains is the one at the position its committed step calls
for. A step that does not commit re-runs the same batch; a group that heals
or restarts from a checkpoint goes on from its own shard at the position of
the step it was given. The position travels with the Manager's state (it is
registered with `register_state_dict_fn`), so healing copies it and
checkpoints save it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from torchft_like.data import DistributedSampler

logger = logging.getLogger(__name__)


class _Stepper(Protocol):
    """What StepBatches needs of the Manager."""

    def current_step(self) -> int: ...

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None: ...


@dataclass(frozen=True)
class Position:
    """Where the batch of committed step `step` begins."""

    step: int
    epoch: int
    batch: int
    """Index of the batch within the epoch."""
    loader: Any = None
    """A stateful loader's own state_dict at this position (None: epoch start,
    or a plain DataLoader, which our DistributedSampler positions)."""


def _is_stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


class StepBatches:
    """Yields the batch of the Manager's current committed step.

    Iterate it once per loop turn, before `optimizer.zero_grad()`. After a
    committed step it yields the next batch of the shard; after an
    uncommitted one the same batch again; after a heal (the step jumped to the
    peer's) the batch at the new step's position, read from our own shard.
    One batch per committed step; epochs roll over on their own (the
    sampler's `set_epoch` is called).

    Supports torchdata's `StatefulDataLoader` (any loader with `state_dict`
    and `load_state_dict`; its state must not name the shard, so that a
    peer's position applies to ours, true of the samplers in torch and
    torchdata and of ours) and a plain DataLoader over our
    `DistributedSampler` (positioned without reading the skipped samples).

    Args:
        manager: the Manager; the position is registered with it under `key`.
        loader: the data loader of this rank's shard.
        key: the state key the position travels under.

    Raises:
        ValueError: a plain DataLoader whose sampler is not our DistributedSampler.
    """

    def __init__(self, manager: _Stepper, loader: Any, key: str = "data") -> None:
        self._stateful = _is_stateful(loader)
        sampler = getattr(loader, "sampler", None)
        if not self._stateful and not isinstance(sampler, DistributedSampler):
            raise ValueError(
                f"cannot position {type(loader).__name__} (sampler "
                f"{type(sampler).__name__}) at a step: use torchdata's StatefulDataLoader, or "
                "a DataLoader whose sampler is torchft_like.DistributedSampler"
            )
        self._manager = manager
        self._loader = loader
        self._sampler = sampler
        self._pos = Position(step=0, epoch=0, batch=0)
        self._it: Iterator[Any] | None = None
        self._current: tuple[Position, Any] | None = None
        """The batch last yielded and the position it began at."""
        manager.register_state_dict_fn(key, self.load_state_dict, self.state_dict)

    def __iter__(self) -> StepBatches:
        return self

    def __next__(self) -> Any:
        step = self._manager.current_step()
        if self._current is not None and self._current[0].step == step:
            return self._current[1]  # the step did not commit: train the same batch
        if step < self._pos.step:
            raise RuntimeError(
                f"the committed step went back from {self._pos.step} to {step}; "
                "a step never goes backwards"
            )
        while True:
            at, batch = self._fetch()
            if at.step == step:
                self._current = (at, batch)
                return batch
            # Behind the step after a heal or a restore: a batch other
            # replicas trained while we were not there.

    def position(self) -> Position:
        """The position of the batch last yielded (before any is: the next one)."""
        return self._current[0] if self._current is not None else self._pos

    def state_dict(self) -> dict[str, Any]:
        """The position of the current committed step: mid-step (serving a
        heal) the batch in flight, after a commit the next one."""
        current = self._current
        if current is not None and current[0].step == self._manager.current_step():
            return asdict(current[0])
        return asdict(self._pos)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pos = Position(**state)
        self._it = None
        self._current = None
        logger.info(
            "data position: step %d, epoch %d, batch %d",
            self._pos.step,
            self._pos.epoch,
            self._pos.batch,
        )

    def _open(self) -> Iterator[Any]:
        pos = self._pos
        set_epoch = getattr(self._sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(pos.epoch)
        if self._stateful:
            # {} resets a StatefulDataLoader to the start of an epoch.
            self._loader.load_state_dict(pos.loader if pos.loader is not None else {})
        else:
            assert isinstance(self._sampler, DistributedSampler)
            self._sampler.set_start(pos.batch * self._loader.batch_size)
        return iter(self._loader)

    def _fetch(self) -> tuple[Position, Any]:
        """The batch at self._pos and its position (the next epoch's start
        when this epoch is used up); moves the position past it."""
        for _ in range(2):  # the second try is at the start of the next epoch
            if self._it is None:
                self._it = self._open()
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                if self._pos.batch == 0:
                    break
                self._pos = Position(step=self._pos.step, epoch=self._pos.epoch + 1, batch=0)
                continue
            at = self._pos
            loader_state = self._loader.state_dict() if self._stateful else None
            self._pos = Position(at.step + 1, at.epoch, at.batch + 1, loader_state)
            return at, batch
        raise ValueError(
            f"the loader yields no batch in epoch {self._pos.epoch}: its shard is smaller than "
            "one batch; use a smaller batch size or drop_last=False"
        )
