"""Exactly-once data: every sample of every epoch trained by one committed step.

The data position is a global cursor in the committed state: the units of
data (one group's batch each) consumed by committed steps, which is the
Manager's `batches_committed()`; it travels with healed state and durable
checkpoints like the rest of the Manager's progress. Each step, participant
r of the quorum trains unit `cursor + r`, and a commit moves the cursor on
by the number of participants. A step that does not commit hands out the
same units again; a healing, dead or spare group trains none (it
contributes zeros). So, whatever dies, heals or restarts, each unit is
trained in exactly one committed step, and a restarted job resumes at the
first unit not yet committed.

The batch is taken before the step's quorum is known, so that loading data
and the forward pass overlap the quorum as before: each group takes the
unit of the rank it forecasts from its last quorum, and says so in its
quorum request. When the participants changed (a group died, or one failed
to commit), the forecast is wrong; every replica sees that in the same
quorum (lighthouse.core.views.batch_slots_wrong), none commits the step,
and the retry takes the units of the new quorum. That costs one step per
change of the participants, as does the death of a group within a step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Protocol

from torchft_like.data.aligned import AlignedBatches, Position, Stepper, is_stateful
from torchft_like.data.claims import BatchSlot
from torchft_like.data.sampler import DistributedSampler

__all__ = ["Position", "StepBatches"]

logger = logging.getLogger(__name__)


class _Manager(Stepper, Protocol):
    """What steering needs of the Manager, beyond Stepper."""

    def batches_committed(self) -> int: ...

    def claim_batch_slot(self) -> BatchSlot: ...


class StepBatches:
    """Yields the batch of the Manager's current step.

    Iterate it once per loop turn, before `optimizer.zero_grad()`; it never
    ends (epochs roll over on their own). With a loader over
    torchft_like.DistributedSampler (a plain DataLoader or torchdata's
    StatefulDataLoader) it yields the unit the quorum gives this group, so
    every sample of each epoch is trained exactly once (see the module). The
    global batch of a step is one unit per participant: it shrinks while a
    group is away, as the number of gradients averaged does.

    A stateful loader over another sampler keeps each group on its own shard,
    one batch per committed step (data.aligned): aligned,
    but the batches of a group's dead or healing steps are skipped.

    With several loader workers, pass `persistent_workers=True`: a change of
    the participants restarts the loader's iterator.

    Args:
        manager: the Manager.
        loader: the data loader of this rank.
        key: the state key an aligned loader's position travels under.

    Raises:
        ValueError: a loader that can be neither steered nor positioned, or a
            data set smaller than one group's batch.
    """

    def __init__(self, manager: _Manager, loader: Any, key: str = "data") -> None:
        sampler = getattr(loader, "sampler", None)
        self._aligned: AlignedBatches | None = None
        if not isinstance(sampler, DistributedSampler):
            if not is_stateful(loader):
                raise ValueError(
                    f"cannot assign batches of {type(loader).__name__} (sampler "
                    f"{type(sampler).__name__}) by step: use a DataLoader or torchdata's "
                    "StatefulDataLoader whose sampler is torchft_like.DistributedSampler"
                )
            logger.warning(
                "StepBatches: %s is not torchft_like.DistributedSampler, so each group reads "
                "its own shard and the batches of steps it misses are skipped; use "
                "torchft_like.DistributedSampler to train every sample of an epoch once",
                type(sampler).__name__,
            )
            self._aligned = AlignedBatches(manager, loader, key)
            return
        if not isinstance(getattr(loader, "batch_size", None), int):
            raise ValueError(
                "StepBatches needs the loader's batch_size (a DataLoader built with "
                "batch_size=N, not a batch_sampler)"
            )
        self._manager = manager
        self._loader = loader
        self._sampler = sampler
        self._batch_size: int = loader.batch_size
        self._units = sampler.units_per_epoch(self._batch_size)
        self._it: Iterator[Any] | None = None
        self._next: tuple[int, int] = (-1, 0)
        """(unit, stride): the unit the open iterator yields next, and its stride."""
        self._last: tuple[Position, Any] | None = None

    def __iter__(self) -> StepBatches:
        return self

    def __next__(self) -> Any:
        if self._aligned is not None:
            return next(self._aligned)
        step = self._manager.current_step()
        forecast = self._manager.claim_batch_slot()
        unit = self._manager.batches_committed() + max(forecast.slot, 0)
        last = self._last
        if last is not None and last[0].step == step and last[0].unit == unit:
            return last[1]  # the step did not commit: the same unit again
        if self._it is None or self._next != (unit, forecast.participants):
            self._sampler.steer(unit, forecast.participants, self._batch_size)
            self._it = iter(self._loader)
        batch = next(self._it)
        self._next = (unit + forecast.participants, forecast.participants)
        epoch, index = divmod(unit, self._units)
        self._last = (Position(step=step, epoch=epoch, batch=index, unit=unit), batch)
        return batch

    def position(self) -> Position:
        """Where the batch last yielded lies (before any: the epoch's start)."""
        if self._aligned is not None:
            return self._aligned.position()
        return self._last[0] if self._last is not None else Position(step=0, epoch=0, batch=0)

    def state_dict(self) -> dict[str, Any]:
        """An aligned loader's position (steered loaders keep theirs in the
        Manager's progress: {})."""
        return self._aligned.state_dict() if self._aligned is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._aligned is not None:
            self._aligned.load_state_dict(state)
