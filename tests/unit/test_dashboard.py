"""The status page's pure parts: history reasons, heals, step rate, goodput, the chart, the page."""

from __future__ import annotations

import json
import re
from collections import deque
from xml.etree import ElementTree

import pytest

from lighthouse.core.heals import HealEvent, apply_report, heals_in_quorum, report_of
from lighthouse.core.history import quorum_entry, why_absent, why_joined
from lighthouse.core.member_data import HealReport
from lighthouse.core.quorum import ArrivalStats, LighthouseConfig, QuorumMember
from lighthouse.status.chart import MAX_LINES, render_chart
from lighthouse.status.dashboard import render_page
from lighthouse.status.progress import MAX_CHARTED, Progress, add_point, goodput, step_rate
from torchft_like.manager.metrics import metrics_port_from_env

CONFIG = LighthouseConfig(min_replicas=1, heartbeat_timeout_ms=5000, suspect_min_ms=700)
STEADY = ArrivalStats(mean_s=0.1, var_s2=0.0001, count=50)


# ---- history ------------------------------------------------------------------


@pytest.mark.parametrize(
    "heartbeats, streams_closed, departed, expected",
    [
        ({}, {}, {"a": "left on purpose (Leave)"}, "left on purpose (Leave)"),
        ({}, {}, {}, "forgotten"),
        ({"a": 99.0}, {"a": 99.5}, {}, "heartbeat stream closed"),
        ({"a": 90.0}, {}, {}, "heartbeat lost: silent 10.0 s, past the heartbeat timeout"),
        ({"a": 98.0}, {}, {}, "suspected hung by phi accrual: silent 2.0 s, usually every 0.10 s"),
        ({"a": 99.95}, {}, {}, "healthy but did not ask in time"),
    ],
)
def test_why_a_member_left_names_the_cause(heartbeats, streams_closed, departed, expected):
    why = why_absent(100.0, "a", heartbeats, streams_closed, {"a": STEADY}, CONFIG, departed)
    assert why.startswith(expected)


@pytest.mark.parametrize(
    "rid, ever, names, expected",
    [
        ("g:1", set(), set(), "new"),
        ("g:1", {"g:1"}, {"g"}, "back after missing a quorum"),
        ("g:2", {"g:1"}, {"g"}, "new process of group 'g' (restarted)"),
        ("plain", set(), {"plain"}, "new"),  # an id without a uuid is its own name
    ],
)
def test_why_a_replica_joined(rid, ever, names, expected):
    assert why_joined(rid, ever, names) == expected


def test_a_quorum_entry_lists_who_joined_and_who_left_with_their_reasons():
    entry = quorum_entry(
        1.0, 7, ("a:1", "b:1"), ("a:1", "b:2", "c:1"), "valid", {"b:1": "gone"}, {"a:1", "b:1"},
        {"a", "b"},
    )  # fmt: skip
    assert entry.quorum_id == 7 and entry.members == ("a:1", "b:2", "c:1")
    assert [(c.replica_id, c.why) for c in entry.joined] == [
        ("b:2", "new process of group 'b' (restarted)"),
        ("c:1", "new"),
    ]
    assert [(c.replica_id, c.why) for c in entry.left] == [("b:1", "gone")]


# ---- heals --------------------------------------------------------------------


def members(*steps: int) -> tuple[QuorumMember, ...]:
    return tuple(
        QuorumMember(f"r{i}", address=f"http://h{i}:1", step=s) for i, s in enumerate(steps)
    )


@pytest.mark.parametrize(
    "steps, expected",
    [
        ((5, 5), []),
        ((5, 3), [("r1", 5, ("r0",))]),
        ((2, 5, 5, 1, 0), [("r0", 5, ("r1",)), ("r3", 5, ("r2",)), ("r4", 5, ("r1",))]),
        ((), []),
    ],
)
def test_members_behind_the_max_step_heal_from_the_rank0_source(steps, expected):
    events = heals_in_quorum(9, members(*steps), 1.0)
    assert [(e.replica_id, e.step, e.sources) for e in events] == expected
    assert all(e.quorum_id == 9 and e.seconds is None for e in events)


@pytest.mark.parametrize(
    "data, expected",
    [
        ("", None),
        ('{"fingerprint": {}}', None),
        ("[1, 2]", None),
        ({"heal": {"step": 2, "seconds": 1, "bytes": 3}}, HealReport(2, 1.0, 3)),
        (
            json.dumps({"heal": {"step": 2, "seconds": 1.5, "bytes": 3, "sources": ["x"]}}),
            HealReport(2, 1.5, 3, ("x",)),
        ),
    ],
)
def test_a_heal_report_is_read_from_member_data_or_ignored(data, expected):
    assert report_of(QuorumMember("r", data=data)) == expected


def test_a_report_fills_its_heal_once_and_adds_one_the_lighthouse_did_not_see():
    events = [HealEvent("r1", 5, ("r0",), 1.0, 9)]
    filled = apply_report(events, "r1", HealReport(5, 0.25, 1000, ("http://h0:1",)), 2.0,
                          {"http://h0:1": "r0"})  # fmt: skip
    assert filled is not None and (filled.seconds, filled.num_bytes, filled.sources) == (
        0.25,
        1000,
        ("r0",),
    )
    assert apply_report(events, "r1", HealReport(5, 9.0, 9), 3.0, {}) is None  # already filled
    added = apply_report(events, "r2", HealReport(0, 0.1, 10, ("http://x:1",)), 4.0, {})
    assert added is not None and added.quorum_id is None and added.sources == ("http://x:1",)
    assert [e.replica_id for e in events] == ["r2", "r1"]


# ---- progress -----------------------------------------------------------------


@pytest.mark.parametrize(
    "commits, first_seen, now, expected",
    [
        ([], 0.0, 10.0, 0.0),
        ([1.0, 2.0, 3.0, 4.0], 0.0, 4.0, 1.0),
        ([2.0, 4.0], 0.0, 4.0, 0.5),
        ([9.0, 9.5], 8.0, 10.0, 1.0),  # seen for 2 s only: over those 2 s
        ([1.0, 50.0, 55.0], 0.0, 60.0, 2 / 30),  # commits older than the window do not count
        ([20.0 + i / 10 for i in range(8)], 0.0, 21.0, 7.0),  # full: over the span held
    ],
)
def test_step_rate_counts_commits_in_the_window(commits, first_seen, now, expected):
    held = deque(commits, maxlen=8)
    assert step_rate(held, first_seen, now, 30.0) == pytest.approx(expected)


@pytest.mark.parametrize(
    "committed, groups, advanced, expected",
    [(0, 0, 0, None), (10, 2, 0, None), (20, 2, 10, 1.0), (15, 2, 10, 0.75), (30, 2, 10, 1.0)],
)
def test_goodput_is_committed_over_possible(committed, groups, advanced, expected):
    assert goodput(committed, groups, advanced) == expected


def test_a_group_that_heals_or_restarts_counts_only_the_steps_it_trained():
    p = Progress()
    for t, (a, b) in enumerate([(0, 0), (1, 1), (2, 2), (3, None), (4, 0), (5, 6), (6, 7)]):
        p.on_quorum(2)
        p.observe("a", a, 100.0 + t, float(t))
        if b is not None:
            p.observe("b", b, 100.0 + t, float(t))
    # a: 6 commits; b: 0->1->2 (2), the restart to 0 and the heal's jump to 6 (none), 6->7 (1).
    assert p.groups["a"].committed == 6 and p.groups["b"].committed == 3
    assert p.steps_advanced() == 7
    assert p.job_goodput() == pytest.approx(9 / 14)
    assert p.group_goodput("a") == pytest.approx(6 / 7)


def test_a_late_group_is_measured_from_the_step_the_job_was_at_when_it_came():
    p = Progress()
    for step in range(11):
        p.observe("a", step, float(step), float(step))
    # b asks at step 0 while the job is at 10, heals to 10 (its jump to 11 is
    # no commit of its own), then trains 11 -> 12.
    for a, b in ((11, 0), (12, 11)):
        p.observe("b", b, 0.0, 0.0)
        p.observe("a", a, 0.0, 0.0)
    p.observe("b", 12, 0.0, 0.0)
    assert p.groups["b"].base_step == 10
    assert p.group_goodput("b") == pytest.approx(1 / 2)


def test_ten_thousand_groups_asking_in_turn_each_keep_their_count():
    """One lighthouse serves 10,000 groups: none is dropped, so each step's
    round of Quorum calls counts one commit per group."""
    p = Progress()
    for step in range(3):
        for i in range(10_000):
            p.observe(f"g{i}", step, 0.0, float(step))
    assert len(p.groups) == 10_000
    assert p.committed_total == 20_000
    assert all(g.committed == 2 for g in p.groups.values())


def test_only_the_first_groups_keep_chart_points():
    p = Progress()
    for i in range(MAX_CHARTED + 3):
        p.observe(f"g{i}", 0, 0.0, 0.0)
    charted = [name for name, g in p.groups.items() if g.points is not None]
    assert charted == [f"g{i}" for i in range(MAX_CHARTED)]


def test_the_chart_points_thin_out_but_keep_the_whole_run():
    points: list[tuple[float, int]] = []
    for i in range(1000):
        add_point(points, (float(i), i), 16)
    assert len(points) <= 16
    assert points[0] == (0.0, 0) and points[-1] == (999.0, 999)
    assert points == sorted(points)


# ---- the chart and the page ---------------------------------------------------


@pytest.mark.parametrize(
    "series, lines, text",
    [
        ({}, 0, "no steps yet"),
        ({"a": [(0.0, 0)]}, 1, "a"),
        ({"b": [(0.0, 0), (5.0, 10)], "a": [(1.0, 0), (2.0, 3)]}, 2, "10"),
        ({f"g{i:02d}": [(0.0, i)] for i in range(MAX_LINES + 4)}, MAX_LINES, "g00"),
        ({"<x>": [(0.0, 1)]}, 1, "<x>"),
    ],
)
def test_the_chart_is_valid_svg_with_one_line_per_group(series, lines, text):
    svg = render_chart(series, now=10.0)
    root = ElementTree.fromstring(svg)  # well-formed, names escaped
    ns = "{http://www.w3.org/2000/svg}"
    polylines = root.findall(f"{ns}polyline")
    assert len(polylines) == lines
    assert text in "".join(root.itertext())
    for line in polylines:
        for xy in line.get("points", "").split():
            x, y = map(float, xy.split(","))
            assert 0 <= x <= 720 and 0 <= y <= 240


def test_the_chart_puts_later_points_right_and_higher_steps_up():
    svg = render_chart({"a": [(0.0, 0), (10.0, 10)]}, now=10.0)
    (first, last, _) = re.search(r'points="([^"]+)"', svg)[1].split()  # type: ignore[index]
    (x0, y0), (x1, y1) = (map(float, p.split(",")) for p in (first, last))
    assert x1 > x0 and y1 < y0


STATUS = {
    "now": 1000.0,
    "quorum_id": 42,
    "quorum_members": ["a:1"],
    "summary": "quorum issued",
    "min_replicas": 1,
    "replicas": [
        {
            "replica_id": "a:1",
            "step": 3,
            "step_rate": 1.5,
            "address": "http://h:1",
            "heartbeat_age_s": 0.1,
            "healthy": True,
            "waiting": False,
            "in_quorum": True,
        }
    ],
    "groups": [
        {
            "name": "a",
            "step": 3,
            "committed": 3,
            "step_rate": 1.5,
            "goodput": 1.0,
            "last_seen": 999.0,
            "points": [[990.0, 0], [999.0, 3]],
        }
    ],
    "goodput": {"value": 0.5},
    "history": [
        {
            "time": 990.0,
            "quorum_id": 42,
            "members": ["a:1"],
            "joined": [{"replica_id": "a:1", "why": "new"}],
            "left": [{"replica_id": "b:1", "why": "heartbeat lost"}],
            "note": "valid",
        },
        {
            "time": 980.0,
            "quorum_id": None,
            "members": [],
            "joined": [],
            "left": [],
            "note": "twin refused: x",
        },  # fmt: skip
    ],
    "heals": [
        {
            "time": 995.0,
            "replica_id": "a:1",
            "sources": ["b:1"],
            "step": 2,
            "quorum_id": 42,
            "seconds": 0.5,
            "bytes": 2_500_000,
        },  # fmt: skip
    ],
    "kill": {"enabled": True, "secret_set": True},
    "spares": [{"spare_id": "run-7/0", "wanted": "", "waiting_s": 12.5}],
}


@pytest.mark.parametrize(
    "kill, form, note",
    [
        ({"enabled": True, "secret_set": True}, True, "type the job's secret"),
        ({"enabled": False, "secret_set": True}, False, "--kill-button"),
        ({"enabled": True, "secret_set": False}, False, "TORCHFT_SECRET_FILE"),
    ],
)
def test_the_page_shows_every_section_and_a_kill_form_only_with_secret_and_flag(kill, form, note):
    page = render_page({**STATUS, "kill": kill})
    for text in ("50.0%", "steps/s", "heartbeat lost", "twin refused: x", "2.5 MB", "0.50 s",
                 '<svg id="steps-chart"', "Goodput: committed replica-steps",
                 "run-7/0", "12.5 s"):  # fmt: skip
        assert text in page
    assert ('action="/kill"' in page) == form
    assert note in page


def test_the_page_of_a_fresh_lighthouse_says_nothing_happened_yet():
    page = render_page(
        {
            "quorum_id": None,
            "quorum_members": [],
            "summary": "no replica",
            "min_replicas": 2,
            "replicas": [],
        }  # fmt: skip
    )
    for text in ("no replica has been heard from yet", "no steps yet", "no heal yet",
                 "no quorum yet", "n/a (no step yet)", "no spare waiting"):  # fmt: skip
        assert text in page


@pytest.mark.parametrize(
    "env, port",
    [
        ({}, None),
        ({"TORCHFT_METRICS_PORT": ""}, None),
        ({"TORCHFT_METRICS_PORT": "0", "LOCAL_RANK": "3"}, 0),
        ({"TORCHFT_METRICS_PORT": "9400", "LOCAL_RANK": "3"}, 9403),
        ({"TORCHFT_METRICS_PORT": "9400"}, 9400),
    ],
)
def test_each_local_rank_serves_metrics_at_the_base_port_plus_its_rank(env, port):
    assert metrics_port_from_env(env) == port


@pytest.mark.parametrize(
    "env, message",
    [
        ({"TORCHFT_METRICS_PORT": "x"}, "TORCHFT_METRICS_PORT='x' is not a port number"),
        ({"TORCHFT_METRICS_PORT": "70000"}, r"TORCHFT_METRICS_PORT \(70000\) must be in"),
    ],
)
def test_a_bad_metrics_port_says_which_variable(env, message):
    with pytest.raises(ValueError, match=message):
        metrics_port_from_env(env)
