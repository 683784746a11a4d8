"""Aligned data for loaders StepBatches cannot steer: each group reads its own
shard, one batch per committed step, with the position as state.

A stateful loader (torchdata's StatefulDataLoader) over a sampler other than
torchft_like.DistributedSampler keeps today's promise: the batch a step
trains is the one at the position its committed step calls for; a step that
does not commit re-runs it; a group that heals or restarts goes on from its
own shard at the position of the step it was given (the position travels
with the Manager's state). The batches of a group's shard for the steps it
was dead or healing are skipped, so an epoch does not cover its data set:
that takes the quorum's assignment (data.step_batches).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class Stepper(Protocol):
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
    or a loader StepBatches steers)."""
    unit: int | None = None
    """The unit of data (steered loaders: batches_committed + participating rank)."""


def is_stateful(loader: Any) -> bool:
    """Whether `loader` has a position of its own (state_dict and load_state_dict)."""
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


class AlignedBatches:
    """One batch per committed step from a stateful loader (see the module).

    Its state must not name the shard, so that a peer's position applies to
    ours (true of the samplers in torch and torchdata).
    """

    def __init__(self, manager: Stepper, loader: Any, key: str = "data") -> None:
        self._manager = manager
        self._loader = loader
        self._sampler = getattr(loader, "sampler", None)
        self._pos = Position(step=0, epoch=0, batch=0)
        self._it: Iterator[Any] | None = None
        self._current: tuple[Position, Any] | None = None
        """The batch last yielded and the position it began at."""
        manager.register_state_dict_fn(key, self.load_state_dict, self.state_dict)

    def __iter__(self) -> AlignedBatches:
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
        # {} resets a StatefulDataLoader to the start of an epoch.
        self._loader.load_state_dict(pos.loader if pos.loader is not None else {})
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
            self._pos = Position(at.step + 1, at.epoch, at.batch + 1, self._loader.state_dict())
            return at, batch
        raise ValueError(
            f"the loader yields no batch in epoch {self._pos.epoch}: its shard is smaller than "
            "one batch; use a smaller batch size or drop_last=False"
        )
