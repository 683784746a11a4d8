"""Which waiting spare trains as which replica group: a function of its inputs."""

from __future__ import annotations

import pytest

from lighthouse.core.spares import SpareRequest, assign_groups

NOW, RESERVE_S = 100.0, 5.0
G01 = {"g0", "g1"}


def spare(sid: str, wanted: str = "", since: float = 90.0) -> SpareRequest:
    return SpareRequest(sid, wanted, since)


@pytest.mark.parametrize(
    "waiting, known, live, held, reserved, expected",
    [
        # Nobody died: a spare waits.
        ([spare("s")], G01, G01, {}, {}, {}),
        # A group died: the spare becomes it.
        ([spare("s")], G01, {"g0"}, {}, {}, {"s": "g1"}),
        # Two died, three spares: the two that waited longest, groups by name.
        (
            [spare("late", since=95), spare("first", since=80), spare("second", since=85)],
            {"g0", "g1", "g2"}, {"g0"}, {}, {},
            {"first": "g1", "second": "g2"},
        ),
        # A group's first start: its name is unknown and free.
        ([spare("s", wanted="g0")], set(), set(), {}, {}, {"s": "g0"}),
        # A restart under its own name, nobody took it: it gets it back, even
        # ahead of a spare that waited longer.
        (
            [spare("old", since=10), spare("restart", wanted="g1", since=99)],
            G01, {"g0"}, {}, {},
            {"restart": "g1"},
        ),
        # A restart whose name is live again (a spare took it): it waits as a spare...
        ([spare("restart", wanted="g1")], G01, G01, {}, {}, {}),
        # ...and takes whichever group dies next.
        ([spare("restart", wanted="g1")], G01, {"g1"}, {}, {}, {"restart": "g0"}),
        # A group handed to a spare that has not joined yet is not handed again...
        ([spare("s2")], G01, {"g0"}, {"s1": "g1"}, {"g1": NOW - 1}, {}),
        # ...nor to a restart wanting it...
        ([spare("restart", wanted="g1")], G01, {"g0"}, {}, {"g1": NOW - 1}, {}),
        # ...unless that spare never joined within the reserve.
        ([spare("s2")], G01, {"g0"}, {}, {"g1": NOW - RESERVE_S - 1}, {"s2": "g1"}),
        # Every rank of a spare gets its group, also once the group is live.
        ([spare("s1")], G01, G01, {"s1": "g1"}, {}, {"s1": "g1"}),
        # Two ranks of one spare waiting: one group, not two.
        (
            [spare("s", since=90), spare("s", since=91)],
            {"g0", "g1", "g2"}, {"g0"}, {}, {},
            {"s": "g1"},
        ),
    ],
)  # fmt: skip
def test_spares_take_the_groups_they_should(waiting, known, live, held, reserved, expected):
    assert assign_groups(NOW, waiting, known, live, held, reserved, RESERVE_S) == expected
