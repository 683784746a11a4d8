"""The heartbeat period the lighthouse advises on HeartbeatPaced streams.

A replica's death closes its stream, which the lighthouse sees at once
(quorum.stream_closed_since_heartbeat); heartbeats on an open stream only
guard against a hung process. So a large job can heartbeat less often: the
advised period grows with the replicas known, keeping the heartbeat messages
per second near a budget however many groups there are, and stays at most a
third of the heartbeat timeout, so a live replica sends at least three
heartbeats per timeout (two may be lost or late without it being declared
dead). Pure functions of their arguments, tested as such (tests/unit).
"""

from __future__ import annotations

import math

HEARTBEAT_BUDGET_PER_S = 1000
"""Heartbeat messages per second the lighthouse aims at from paced streams
(1000 groups: one heartbeat each per second)."""
MIN_ADVICE_MS = 100
"""The shortest period advised: torchft's default heartbeat period."""
ADVICE_STEP_MS = 100
"""Advice is a multiple of this, so a job growing by one group does not
change it (nor send a new advice on every stream)."""
TIMEOUT_FRACTION = 3
"""Advice is at most heartbeat_timeout_ms / TIMEOUT_FRACTION."""
SUSPECT_PERIODS = 2
"""A replica is not suspected hung before SUSPECT_PERIODS advised periods of
silence (see suspect_floor_ms): one period late is the normal case right
after the advice grew and the replica's rhythm has not caught up yet."""


def advised_interval_ms(
    replicas: int, heartbeat_timeout_ms: int, budget_per_s: int = HEARTBEAT_BUDGET_PER_S
) -> int:
    """The heartbeat period to advise with `replicas` known replicas.

    replicas / period stays at or under `budget_per_s`, rounded up to
    ADVICE_STEP_MS, never under MIN_ADVICE_MS and never over a third of the
    heartbeat timeout (which wins when the two clash: a timeout under 300 ms
    gets timeout / 3).

    Raises:
        ValueError: a negative replica count, or a timeout or budget under 1.
    """
    if replicas < 0:
        raise ValueError(f"replicas ({replicas}) must not be negative")
    if heartbeat_timeout_ms < 1:
        raise ValueError(f"heartbeat_timeout_ms ({heartbeat_timeout_ms}) must be positive")
    if budget_per_s < 1:
        raise ValueError(f"budget_per_s ({budget_per_s}) must be at least 1")
    wanted_ms = math.ceil(replicas * 1000 / budget_per_s / ADVICE_STEP_MS) * ADVICE_STEP_MS
    cap_ms = max(1, heartbeat_timeout_ms // TIMEOUT_FRACTION)
    return min(max(wanted_ms, MIN_ADVICE_MS), cap_ms)


def suspect_floor_ms(suspect_min_ms: int, advice_ms: int) -> int:
    """The silence under which no replica is suspected hung: the configured
    floor, raised to SUSPECT_PERIODS advised periods (phi accrual learns a
    replica's rhythm over its last ~10-20 heartbeats; when the advice grows,
    the first longer gaps would look like a hang without this)."""
    return max(suspect_min_ms, SUSPECT_PERIODS * advice_ms)
