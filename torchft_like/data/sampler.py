"""A DistributedSampler that shards data over every rank of every replica group,
and that torchft_like.StepBatches steers unit by unit for exactly-once epochs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import data


class DistributedSampler(data.distributed.DistributedSampler):
    """Shards `dataset` over all ranks of all replica groups.

    The global rank is `group_rank + num_replicas * replica_rank` and the
    global world size `num_replicas * num_replica_groups`, so rank r of every
    group reads a different shard, and the ranks of one group do too.

    Under torchft_like.StepBatches the quorum assigns the data instead: an
    epoch is a sequence of *units*, each one group's batch (`batch_size`
    samples for each of its ranks), taken from the epoch's permutation in
    order; the participants of a step train the next units, one each, and
    rank r of a group reads the r-th `batch_size` samples of its unit. The
    samples past the last whole unit of an epoch are skipped, as with
    drop_last. `replica_rank` and `num_replica_groups` then do not matter.

    Args:
        dataset: the dataset to shard.
        replica_rank: index of this replica group (0 .. num_replica_groups-1).
        num_replica_groups: number of replica groups in the job.
        group_rank: rank inside the group (default: RANK from torchrun, else 0).
        num_replicas: ranks per group (default: WORLD_SIZE from torchrun, else 1).
        **kwargs: shuffle, seed, drop_last, as for torch's DistributedSampler.
    """

    def __init__(
        self,
        dataset: data.Dataset[Any],
        replica_rank: int,
        num_replica_groups: int,
        group_rank: int | None = None,
        num_replicas: int | None = None,
        **kwargs: Any,
    ) -> None:
        group_rank = group_rank if group_rank is not None else int(os.environ.get("RANK", 0))
        num_replicas = (
            num_replicas if num_replicas is not None else int(os.environ.get("WORLD_SIZE", 1))
        )
        if not 0 <= replica_rank < num_replica_groups:
            raise ValueError(
                f"replica_rank ({replica_rank}) must be in [0, {num_replica_groups}) "
                "(num_replica_groups)"
            )
        if not 0 <= group_rank < num_replicas:
            raise ValueError(
                f"group_rank ({group_rank}) must be in [0, num_replicas={num_replicas})"
            )
        self.group_rank, self.group_size = group_rank, num_replicas
        self.global_rank = group_rank + num_replicas * replica_rank
        self.global_world_size = num_replicas * num_replica_groups
        super().__init__(
            dataset, num_replicas=self.global_world_size, rank=self.global_rank, **kwargs
        )
        self._steer: tuple[int, int, int] | None = None
        self._perm: tuple[int, list[int]] = (-1, [])

    def units_per_epoch(self, batch_size: int) -> int:
        """Whole units (one group's batch: `batch_size` per rank) in an epoch.

        Raises:
            ValueError: the data set holds less than one unit.
        """
        units = len(self.dataset) // (batch_size * self.group_size)  # type: ignore[arg-type]
        if units == 0:
            raise ValueError(
                f"the data set ({len(self.dataset)} samples) is smaller than one replica "  # type: ignore[arg-type]
                f"group's batch ({batch_size} per rank x {self.group_size} ranks): use a "
                "smaller batch size"
            )
        return units

    def steer(self, first_unit: int, stride: int, batch_size: int) -> None:
        """Makes later iterations yield, without end, this rank's samples of
        units `first_unit`, `first_unit + stride`, ... (StepBatches: the
        units this group trains if the participants stay as forecast)."""
        if first_unit < 0 or stride < 1:
            raise ValueError(f"first_unit ({first_unit}) must be >= 0 and stride ({stride}) >= 1")
        self.units_per_epoch(batch_size)
        self._steer = (first_unit, stride, batch_size)

    def unit_indices(self, unit: int, batch_size: int) -> list[int]:
        """This rank's sample indices of `unit` (counted from the first
        epoch's first unit)."""
        epoch, index = divmod(unit, self.units_per_epoch(batch_size))
        if self._perm[0] != epoch:
            n = len(self.dataset)  # type: ignore[arg-type]
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._perm = (epoch, torch.randperm(n, generator=g).tolist())
            else:
                self._perm = (epoch, list(range(n)))
        start = (index * self.group_size + self.group_rank) * batch_size
        return self._perm[1][start : start + batch_size]

    def _steered(self, first_unit: int, stride: int, batch_size: int) -> Iterator[int]:
        unit = first_unit
        while True:
            yield from self.unit_indices(unit, batch_size)
            unit += stride

    def __iter__(self) -> Iterator[Any]:
        if self._steer is not None:
            return self._steered(*self._steer)
        return super().__iter__()
