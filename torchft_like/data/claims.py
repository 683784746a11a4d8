"""The batch slot a rank claims for StepBatches, and the quorum's verdict on it.

StepBatches takes unit `batches_committed + slot` of the data before the
step's quorum is known, by the slot forecast from the last quorum; the claim
travels in the next quorum request, and the quorum says whether every
participant's claim was its participating rank (the lighthouse's verdict,
lighthouse.core.views.batch_slots_wrong).
"""

from __future__ import annotations

from dataclasses import dataclass

from lighthouse.core.views import QuorumResult


@dataclass(frozen=True)
class BatchSlot:
    """A forecast of the next step's participation (Manager.claim_batch_slot)."""

    slot: int
    """Our participating rank: the unit of data we train is
    batches_committed + slot. -1 before any quorum."""
    participants: int
    """How many participate, each taking the next unit: the stride between
    our units of consecutive steps."""


def slot_forecast(
    result: QuorumResult, cap: int | None, committed: bool, participating: tuple[int, int | None]
) -> BatchSlot:
    """Next step's participation, forecast from this step's quorum `result`.

    If this step `committed`, every member of the quorum is likely to be at
    one step next and count, in replica_id order (spares, ranked past `cap`,
    keep their rank; they train no unit). If it did not, no one is likely
    to have committed, and the participants stay this step's
    (`participating`: their count and our rank, None when we do not count).
    """
    if not committed:
        count, rank = participating
        return BatchSlot(slot=-1 if rank is None else rank, participants=max(count, 1))
    count = result.replica_world_size if cap is None else min(cap, result.replica_world_size)
    return BatchSlot(slot=result.replica_rank, participants=max(count, 1))


class BatchClaims:
    """One rank's claims, step after step (used by the Manager)."""

    def __init__(self) -> None:
        self._last: tuple[QuorumResult, int | None] | None = None
        """The last quorum's result and spare cap, forecast from."""
        self._claimed: int | None = None

    def claim(self, committed: bool, participating: tuple[int, int | None]) -> BatchSlot:
        """Forecasts next step's slot (-1 before any quorum) and claims it.

        Args:
            committed: whether our last step committed.
            participating: the last step's participants and our rank among them.
        """
        if self._last is None:
            forecast = BatchSlot(slot=-1, participants=1)
        else:
            forecast = slot_forecast(*self._last, committed, participating)
        self._claimed = forecast.slot
        return forecast

    def take(self) -> int | None:
        """The claim for the quorum request being sent (None: no claim), once."""
        claimed, self._claimed = self._claimed, None
        return claimed

    def verdict(
        self, result: QuorumResult, cap: int | None, every_member_counts: bool
    ) -> Exception | None:
        """Notes `result` to forecast from; the error that keeps this step
        from committing when a participant's batch is not the quorum's."""
        self._last = (result, cap)
        wrong = result.batch_slots_wrong_all if every_member_counts else result.batch_slots_wrong
        return RuntimeError(f"batches not the quorum's: {wrong}") if wrong else None
