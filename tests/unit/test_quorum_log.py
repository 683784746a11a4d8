"""A wait for a quorum is reported calmly mid-step and with its reason once stalled."""

from __future__ import annotations

from lighthouse.core.quorum_log import STALL_AFTER_S, waiting_report

REASON = "no majority: 1 joined of 2 healthy, need more than half to avoid split brain"


def test_a_short_wait_is_a_calm_count_not_the_alarming_reason():
    report = waiting_report(10.2, 10.0, num_joined=1, num_healthy=2, reason=REASON)
    assert not report.stalled
    assert report.summary == (
        "step in progress: waiting for 1 of 2 healthy replicas to ask for the next quorum (1 asked)"
    )
    assert "split brain" not in report.summary


def test_a_wait_past_the_stall_bound_is_reported_with_its_reason():
    report = waiting_report(10.0 + STALL_AFTER_S, 10.0, 1, 2, REASON)
    assert report.stalled
    assert report.summary == f"stalled for {STALL_AFTER_S:.0f} s: {REASON}"


def test_the_stall_bound_can_be_set_and_a_clock_step_back_is_no_stall():
    assert waiting_report(11.0, 10.0, 1, 2, REASON, stall_after_s=1.0).stalled
    assert not waiting_report(9.0, 10.0, 1, 2, REASON).stalled
