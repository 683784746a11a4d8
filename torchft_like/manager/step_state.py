"""What one step of a Manager has done so far; each start_quorum starts a new one.

Apart from rank.py (the Manager's step machine) so that beginning a step is one assignment rather
than a reset of each field (a field forgotten there would leak into the
next step). The fields torchft's tests and our wrappers read or set
(`_errored`, `_healing`, `_participating_rank`, ...) stay on the Manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


@dataclass
class StepState:
    """Written by the training thread and by the step's quorum thread."""

    started: float = 0.0
    """When start_quorum began the step (monotonic seconds)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent on the quorum (`quorum_s`) and on receiving a healing
    state (`heal_recv_s`)."""
    quorum_error: Exception | None = None
    """Why this step's quorum failed, if it did."""
    quorum_max_step: int = 0
    """The quorum's highest step."""
    healed: bool = False
    """The quorum made us copy the state from a peer."""
    serving: bool = False
    """The quorum made us serve our state to a healing peer."""
    pending_state_dict: dict[str, Any] | None = None
    """The healing state received, until it is applied."""
    pending_work: list[dist.Work] = field(default_factory=list)
    """The step's allreduces, waited for before the vote."""
