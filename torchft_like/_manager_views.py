"""What a training loop reads of its Manager between calls, by torchft's names.

Kept apart from the Manager's step machinery (torchft_like.manager), which
sets the state these report.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from torchft_like._step_state import StepState


class ManagerViews:
    """The Manager's read-only accessors (the Manager is their only subclass)."""

    _step: int
    _batches_committed: int
    _num_participants: int
    _participating_rank: int | None
    _quorum_id: int
    _quorum_future: Future[None] | None
    _step_state: StepState
    _metrics_server: Any

    def wait_quorum(self) -> None:
        raise NotImplementedError

    def _wait_collectives_ready(self) -> None:
        raise NotImplementedError

    def current_step(self) -> int:
        return self._step

    def batches_committed(self) -> int:
        """Units of data (one group's batch each) trained by committed steps:
        the participants of each committed step, summed; StepBatches' cursor."""
        return self._batches_committed

    def num_participants(self) -> int:
        """Replicas that count in this step's collectives; 0 before the
        first quorum (torchtitan's checkpointer asks after every step)."""
        if self._quorum_future is None:
            return 0
        self._wait_collectives_ready()
        return self._num_participants

    def participating_rank(self) -> int | None:
        """Our rank among this step's participants; None when we do not
        count (healing) or before the first quorum."""
        if self._quorum_future is None:
            return None
        self._wait_collectives_ready()
        return self._participating_rank

    def is_participating(self) -> bool:
        return self.participating_rank() is not None

    def quorum_id(self) -> int:
        return self._quorum_id

    def did_heal(self) -> bool:
        """Whether this step's quorum made us copy the state from a peer."""
        return self._step_state.healed

    def is_serving_state(self) -> bool:
        """Whether this step's quorum made us serve our state to a healing
        peer. The transfer reads the live tensors until should_commit, so a
        caller that writes them before (DiLoCo's inner steps while a sync is
        in flight) waits for the peer first."""
        self.wait_quorum()
        return self._step_state.serving

    def metrics_address(self) -> str | None:
        """`http://host:port/metrics` of this rank's metrics, or None when not served."""
        return self._metrics_server.address() if self._metrics_server else None

    def timings(self) -> dict[str, float]:
        """Seconds spent on this step's quorum (`quorum_s`), and on receiving a
        healing state (`heal_recv_s`) when there was one."""
        return dict(self._step_state.timings)
