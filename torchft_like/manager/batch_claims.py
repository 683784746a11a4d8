"""The batch slot a rank claims for StepBatches, and the quorum's verdict on it.

StepBatches takes unit `batches_committed + slot` of the data before the
step's quorum is known, by the slot forecast from the last quorum; the claim
travels in the next quorum request, and the quorum says whether every
participant's claim was its participating rank (recovery.batch_slots_wrong).
"""

from __future__ import annotations

from torchft_like.recovery import BatchSlot, QuorumResult, slot_forecast


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
