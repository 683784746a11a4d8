"""A DistributedSampler that shards data over every rank of every replica group."""

from __future__ import annotations

import os
from collections.abc import Iterator
from itertools import islice
from typing import Any

from torch.utils import data


class DistributedSampler(data.distributed.DistributedSampler):
    """Shards `dataset` over all ranks of all replica groups.

    The global rank is `group_rank + num_replicas * replica_rank` and the
    global world size `num_replicas * num_replica_groups`, so rank r of every
    group reads a different shard, and the ranks of one group do too.

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
        self.global_rank = group_rank + num_replicas * replica_rank
        self.global_world_size = num_replicas * num_replica_groups
        super().__init__(
            dataset, num_replicas=self.global_world_size, rank=self.global_rank, **kwargs
        )
        self.start = 0
        """Index into this epoch's shard where iteration begins, so a loader
        resumes mid-epoch without reading the samples before it
        (torchft_like.StepBatches sets it)."""

    def set_start(self, start: int) -> None:
        """Begins every later iteration at `start` (0: the shard's beginning)."""
        if not 0 <= start <= self.num_samples:
            raise ValueError(
                f"start ({start}) must be in [0, {self.num_samples}] (the samples per shard "
                "in an epoch); pass the index of the first sample to read this epoch"
            )
        self.start = start

    def __iter__(self) -> Iterator[Any]:
        return islice(super().__iter__(), self.start, None)
