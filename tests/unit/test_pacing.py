"""The advised heartbeat period (lighthouse.core.pacing) as a pure function."""

from __future__ import annotations

import pytest

from lighthouse.core.pacing import advised_interval_ms, suspect_floor_ms


@pytest.mark.parametrize(
    ("replicas", "timeout_ms", "budget_per_s", "expected_ms", "why"),
    [
        (0, 5000, 1000, 100, "no replica yet: the shortest period"),
        (1, 5000, 1000, 100, "a small job heartbeats at torchft's 100 ms"),
        (100, 5000, 1000, 100, "100 groups at 10/s: within the budget"),
        (101, 5000, 1000, 200, "rounded up to a 100 ms step"),
        (150, 5000, 1000, 200, "150 ms rounds up to 200"),
        (300, 5000, 1000, 300, "300 groups: 1000 messages/s"),
        (1000, 5000, 1000, 1000, "1000 groups: one heartbeat a second each"),
        (4000, 5000, 1000, 1666, "capped at a third of the timeout"),
        (1000, 3000, 1000, 1000, "the cap (1000) is just met"),
        (1000, 2000, 1000, 666, "the cap wins over the budget"),
        (10, 200, 1000, 66, "a short timeout wins over the 100 ms floor"),
        (10, 1, 1000, 1, "never zero"),
        (1000, 5000, 2000, 500, "a larger budget, a shorter period"),
        (100_000, 60_000, 1000, 20_000, "huge job, long timeout: still a third of it"),
    ],
)
def test_advised_interval(replicas, timeout_ms, budget_per_s, expected_ms, why):
    advice = advised_interval_ms(replicas, timeout_ms, budget_per_s)
    assert advice == expected_ms, why
    assert advice <= max(1, timeout_ms // 3), "at least three heartbeats per timeout"


def test_advice_never_shrinks_as_the_job_grows():
    advice = [advised_interval_ms(n, 5000) for n in range(0, 3000, 7)]
    assert advice == sorted(advice)


@pytest.mark.parametrize(
    ("suspect_min_ms", "advice_ms", "expected_ms"),
    [(700, 100, 700), (700, 300, 700), (700, 400, 800), (700, 1000, 2000), (0, 1666, 3332)],
)
def test_suspect_floor_covers_two_advised_periods(suspect_min_ms, advice_ms, expected_ms):
    assert suspect_floor_ms(suspect_min_ms, advice_ms) == expected_ms


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1, 5000), "replicas"),
        ((10, 0), "heartbeat_timeout_ms"),
        ((10, 5000, 0), "budget_per_s"),
    ],
)
def test_bad_arguments_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        advised_interval_ms(*args)
