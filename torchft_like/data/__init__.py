"""Exactly-once data: every sample of an epoch trained by one committed step.

The rooms, from the user's loop down to the quorum:

- `step_batches`: StepBatches, the batch of the Manager's current step (the
  global cursor, `Manager.batches_committed()`, plus this group's slot);
- `sampler`: DistributedSampler, the shards StepBatches steers unit by unit
  (torchft's `torchft.data` name);
- `aligned`: AlignedBatches, for stateful loaders it cannot steer (one batch
  per committed step from the group's own shard);
- `claims`: the slot a rank forecasts from its last quorum and claims in the
  next request (BatchSlot, BatchClaims, used by the Manager).

The quorum's verdict on the claims is the lighthouse's
(`lighthouse.core.views.batch_slots_wrong`): every replica reads it from the same
quorum, so none commits a step whose batches were not the quorum's.
"""

from torchft_like.data.aligned import AlignedBatches, Position
from torchft_like.data.claims import BatchClaims, BatchSlot, slot_forecast
from torchft_like.data.sampler import DistributedSampler
from torchft_like.data.step_batches import StepBatches

__all__ = [
    "AlignedBatches",
    "BatchClaims",
    "BatchSlot",
    "DistributedSampler",
    "Position",
    "StepBatches",
    "slot_forecast",
]
