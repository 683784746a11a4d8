"""What the lighthouse says of a quorum not yet issued: calm while a step is
under way, the full reason once the wait looks like a stall.

In a healthy job every step has a moment when some groups have asked and
the others are still computing: "no majority: 1 joined of 2 healthy" is then
true but not news, and logging it each step drowned the log (800 of 811
lines in a two-group job). Pure: time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

STALL_AFTER_S = 5.0
"""A wait longer than this since the first join is a stall: logged at INFO
with its reason and shown on the status page. Steps whose groups ask more
than 5 s apart see one such line per step; raise it for them."""


@dataclass(frozen=True)
class WaitingReport:
    stalled: bool
    """Waited at least `stall_after_s`: worth an INFO line."""
    summary: str
    """The status-page text: the calm count, or the reason once stalled."""


def waiting_report(
    now: float,
    first_joined_at: float,
    num_joined: int,
    num_healthy: int,
    reason: str,
    stall_after_s: float = STALL_AFTER_S,
) -> WaitingReport:
    """How to report a wait that began at `first_joined_at` (monotonic s)."""
    waited_s = max(0.0, now - first_joined_at)
    if waited_s >= stall_after_s:
        return WaitingReport(True, f"stalled for {waited_s:.0f} s: {reason}")
    return WaitingReport(
        False,
        f"step in progress: waiting for {max(num_healthy - num_joined, 0)} of {num_healthy} "
        f"healthy replicas to ask for the next quorum ({num_joined} asked)",
    )
