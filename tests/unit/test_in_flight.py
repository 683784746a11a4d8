"""ProcessGroupNCCL's timeout rule (process_group.in_flight), table-driven: no clock, no thread."""

from __future__ import annotations

import pytest

from torchft_like.process_group.in_flight import RELEASE_S, InFlight, Issued


def issued(name: str, deadline: float, done: bool) -> Issued:
    return Issued(name, deadline, lambda: done)


@pytest.mark.parametrize(
    "queue, now, overdue, next_look, left",
    [
        ([], 0.0, None, None, 0),
        ([("a", 10.0, True)], 0.0, None, None, 0),
        ([("a", 10.0, False)], 0.0, None, RELEASE_S, 1),
        ([("a", 10.0, False)], 9.8, None, 10.0, 1),
        ([("a", 10.0, False)], 10.0, "a", None, 1),
        # the finished ones in front are let go; the oldest unfinished one is judged
        ([("a", 1.0, True), ("b", 2.0, True), ("c", 3.0, False)], 3.5, "c", None, 1),
        ([("a", 1.0, True), ("b", 2.0, False), ("c", 3.0, False)], 1.5, None, 1.5 + RELEASE_S, 2),
        # one finished behind an unfinished one waits for it (in order)
        ([("a", 5.0, False), ("b", 6.0, True)], 5.0, "a", None, 2),
    ],
)
def test_look(queue, now, overdue, next_look, left) -> None:
    flight = InFlight()
    for name, deadline, done in queue:
        flight.add(issued(name, deadline, done))
    look = flight.look(now)
    assert (look.overdue.name if look.overdue else None) == overdue
    assert (
        look.next_look == pytest.approx(next_look)
        if next_look is not None
        else look.next_look is None
    )
    assert len(flight) == left


def test_add_says_when_the_watchdog_must_wake() -> None:
    flight = InFlight()
    assert flight.add(issued("a", 1.0, False)) is True
    assert flight.add(issued("b", 2.0, False)) is False
    flight.clear()
    assert len(flight) == 0
    assert flight.add(issued("c", 3.0, False)) is True
