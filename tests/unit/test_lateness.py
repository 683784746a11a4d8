"""lighthouse.core.lateness: deadlines instead of a scan, as a table."""

from __future__ import annotations

import pytest

from lighthouse.core.lateness import Lateness

# (events, want): events are ("heard", key, at) or ("expired", now, after_s);
# want is what each "expired" returns, in order.
CASES = [
    ("silent past the deadline", [("heard", "a", 0.0), ("expired", 5.0, 5.0)], [["a"]]),
    ("not yet", [("heard", "a", 0.0), ("expired", 4.9, 5.0)], [[]]),
    (
        "heard since: the deadline moves on",
        [("heard", "a", 0.0), ("heard", "a", 3.0), ("expired", 5.0, 5.0), ("expired", 8.0, 5.0)],
        [[], ["a"]],
    ),
    (
        "returned once until heard again",
        [
            ("heard", "a", 0.0),
            ("expired", 5.0, 5.0),
            ("expired", 9.0, 5.0),
            ("heard", "a", 10.0),
            ("expired", 15.0, 5.0),
        ],
        [["a"], [], ["a"]],
    ),
    (
        "a forgotten key is dropped",
        [("heard", "gone", 0.0), ("forget", "gone"), ("expired", 6.0, 5.0)],
        [[]],
    ),
    (
        "several, in deadline order",
        [("heard", "b", 1.0), ("heard", "a", 0.0), ("heard", "c", 9.0), ("expired", 7.0, 5.0)],
        [["a", "b"]],
    ),
    (
        "a longer silence than armed with: re-armed, not late",
        [("heard", "a", 0.0), ("expired", 1.0, 0.5), ("heard", "b", 0.0), ("expired", 1.0, 2.0)],
        [["a"], []],
    ),
]


@pytest.mark.parametrize(("name", "events", "want"), CASES, ids=[c[0] for c in CASES])
def test_lateness(name, events, want):
    lateness, heard, got = Lateness(), {}, []
    for event in events:
        if event[0] == "heard":
            _, key, at = event
            heard[key] = at
            lateness.heard(key, at, 0.5 if name.startswith("a longer") else 5.0)
        elif event[0] == "forget":
            del heard[event[1]]
        else:
            _, now, after_s = event
            got.append(sorted(lateness.expired(now, heard, after_s)))
    assert got == want


def test_a_tick_with_nobody_due_looks_at_no_key():
    lateness = Lateness()
    heard = {f"r{i}": 0.0 for i in range(10_000)}
    for key, at in heard.items():
        lateness.heard(key, at, 5.0)
    assert lateness.expired(4.0, heard, 5.0) == []
    assert len(lateness) == 10_000  # nothing popped, nothing re-armed
