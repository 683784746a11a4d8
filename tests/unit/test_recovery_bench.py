"""bench.recovery's survivor figures, from commit times alone."""

from __future__ import annotations

import pytest

from bench.recovery import longest_gap, step_gap


@pytest.mark.parametrize(
    ("times", "start", "end", "expected"),
    [
        # the gap that spans the kill counts, from the commit before it
        ([1.0, 1.1, 1.2, 2.5, 2.6], 1.25, 1.25, 1.3),
        # the window reaches one commit past its end
        ([1.0, 1.1, 1.2, 2.5, 4.0], 1.15, 2.0, 1.3),
        # the longest of several gaps in the window
        ([0.0, 0.5, 0.6, 2.6, 2.7], 0.4, 2.65, 2.0),
        # fewer than two commits: no gap
        ([1.0], 0.5, 2.0, None),
        ([], 0.5, 2.0, None),
    ],
)
def test_longest_gap_spans_the_window_from_the_commit_before_it(
    times: list[float], start: float, end: float, expected: float | None
) -> None:
    assert longest_gap(times, start, end) == expected


@pytest.mark.parametrize(
    ("steps", "step", "expected"),
    [
        ({4: 1.0, 5: 1.2, 6: 2.0}, 6, 0.8),
        ({4: 1.0, 6: 2.0}, 6, None),  # the step before was never committed
        ({4: 1.0, 5: 1.2}, 6, None),
    ],
)
def test_step_gap_is_the_time_between_two_consecutive_commits(
    steps: dict[int, float], step: int, expected: float | None
) -> None:
    commits = [{"step": s, "t": t} for s, t in steps.items()]
    assert step_gap(commits, step) == expected
