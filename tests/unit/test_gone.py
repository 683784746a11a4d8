"""Who of the latest quorum is gone and who hears of it (lighthouse.core.gone),
and what a rank does with a notice (torchft_like.manager.gone_watch): tables, the
time passed in, no sockets."""

from __future__ import annotations

import pytest

from lighthouse.core import gone as gone_module
from lighthouse.core.gone import LOG_NAMES, GoneNotice, GoneWatch, judge_gone
from lighthouse.core.quorum import ArrivalStats, LighthouseConfig
from torchft_like.manager.gone_watch import GroupNotices, StepBreaks, gone_in_quorum

CONFIG = LighthouseConfig(min_replicas=1, heartbeat_timeout_ms=1000)
RHYTHM = ArrivalStats(mean_s=0.1, var_s2=0.0001, count=50)
"""A replica that heartbeat every 100 ms for a while."""


@pytest.mark.parametrize(
    "heartbeats, closed, arrivals, want",
    [
        # Heard from 50 ms ago, stream open: not gone.
        ({"a": 9.95}, {}, {"a": RHYTHM}, {}),
        # Its stream closed after its last heartbeat: dead, at once.
        ({"a": 9.95}, {"a": 9.99}, {}, {"a": "heartbeat stream closed"}),
        # A stream closed before a later heartbeat (a reconnect): not gone.
        ({"a": 9.95}, {"a": 9.9}, {"a": RHYTHM}, {}),
        # Silent past the heartbeat timeout.
        ({"a": 8.9}, {}, {}, {"a": "silent 1.1 s, past the heartbeat timeout"}),
        # Silent 0.8 s against a 100 ms rhythm: hung (phi accrual).
        ({"a": 9.2}, {}, {"a": RHYTHM}, {"a": "suspected hung: silent 0.8 s"}),
        # ...but not under the 700 ms floor, nor without a known rhythm.
        ({"a": 9.4}, {}, {"a": RHYTHM}, {}),
        ({"a": 9.2}, {}, {}, {}),
        # Left or forgotten: no heartbeat known at all.
        ({}, {}, {}, {"a": "left or forgotten"}),
    ],
)  # fmt: skip
def test_judge_gone(heartbeats, closed, arrivals, want):
    got = judge_gone(10.0, ["a"], heartbeats, closed, arrivals, CONFIG)
    assert got.keys() == want.keys()
    for rid, why in want.items():
        assert got[rid].startswith(why), got[rid]


def test_only_members_are_judged():
    assert judge_gone(10.0, ["a"], {"a": 9.95, "b": 1.0}, {}, {}, CONFIG) == {}


@pytest.mark.parametrize("members, dead", [(3, 1), (40, 30), (10_000, 2)])
def test_a_notice_is_logged_in_a_line_of_bounded_length(members, dead):
    watch = GoneWatch()
    rids = [f"group{i:05d}" for i in range(members)]
    watch.issued(7, rids)
    notice = watch.judged({rid: "heartbeat stream closed" for rid in rids[:dead]})
    assert notice is not None
    line = watch.describe(notice)
    assert line.startswith("quorum 7: members gone (group00000: heartbeat stream closed")
    assert len(line) < 1200
    assert (f"and {members - dead - LOG_NAMES} more" in line) == (members - dead > LOG_NAMES)
    assert (f"and {dead - LOG_NAMES} more" in line) == (dead > LOG_NAMES)


def test_members_already_judged_gone_are_not_judged_again(monkeypatch):
    """After thousands die together every tick sees them late or closed:
    only members not yet judged gone are looked at one by one."""
    looked_at: list[set[str]] = []
    real = gone_module.judge_gone

    def spy(now, members, *args):
        looked_at.append(set(members))
        return real(now, members, *args)

    monkeypatch.setattr(gone_module, "judge_gone", spy)
    watch = GoneWatch()
    watch.issued(7, ["a", "b", "c"])
    closed = {"a": 9.0, "b": 9.0}
    heartbeats = {"a": 8.0, "b": 8.0, "c": 9.9}
    first = watch.judge(10.0, {"a", "b", "z"}, heartbeats, closed, {}, CONFIG)
    assert first == GoneNotice(7, ("a", "b"), ("c",))
    assert watch.judge(10.1, {"a", "b", "z"}, heartbeats, closed, {}, CONFIG) is None
    assert looked_at == [{"a", "b"}, set()]


def notices(script: list[tuple]) -> list[GoneNotice | None]:
    watch = GoneWatch()
    out: list[GoneNotice | None] = []
    for event, *args in script:
        if event == "issued":
            watch.issued(args[0], args[1])
        elif event == "judged":
            out.append(watch.judged(args[0]))
        elif event == "heard":
            out.append(watch.heard_from(args[0]))
        elif event == "any":
            out.append(watch.any_gone())  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize(
    "script, want",
    [
        # No quorum yet: nothing to tell.
        ([("judged", {"c": "x"})], [None]),
        # c of quorum 7 gone: a and b hear of it, once.
        ([("issued", 7, "abc"), ("judged", {"c": "dead"}), ("judged", {"c": "dead"})],
         [GoneNotice(7, ("c",), ("a", "b")), None]),
        # A replica that is not a member is no news.
        ([("issued", 7, "ab"), ("judged", {"z": "dead"})], [None]),
        # The set grows: the live ones hear of every member gone so far.
        ([("issued", 7, "abc"), ("judged", {"c": "hung"}), ("judged", {"b": "dead"})],
         [GoneNotice(7, ("c",), ("a", "b")), GoneNotice(7, ("b", "c"), ("a",))]),
        # Every member gone: nobody left to tell.
        ([("issued", 7, "a"), ("judged", {"a": "dead"})], [None]),
        # A gone member heard from again (SIGCONT) is told, once per growth;
        # a live member's heartbeat is no news.
        ([("issued", 7, "abc"), ("judged", {"c": "hung"}), ("heard", "c"), ("heard", "c"),
          ("heard", "a")],
         [GoneNotice(7, ("c",), ("a", "b")), GoneNotice(7, ("c",), ("c",)), None, None]),
        # A new quorum starts over: no notice about it yet, a new id needed no more.
        ([("issued", 7, "abc"), ("judged", {"c": "hung"}), ("any",), ("issued", 8, "ab"),
          ("any",), ("heard", "c")],
         [GoneNotice(7, ("c",), ("a", "b")), True, False, None]),
    ],
)  # fmt: skip
def test_gone_watch(script, want):
    assert notices(script) == want


@pytest.mark.parametrize(
    "quorum_id, gone, latest, want",
    [
        (7, ("c",), (7, ("a", "b", "c")), ("c",)),
        # An older (or newer) quorum's notice: no alarm.
        (6, ("c",), (7, ("a", "b", "c")), ()),
        # A replica not in our quorum: no alarm.
        (7, ("z",), (7, ("a", "b", "c")), ()),
        (7, ("z", "c"), (7, ("a", "b", "c")), ("c",)),
        # No quorum yet (or local collectives only).
        (7, ("c",), None, ()),
    ],
)
def test_gone_in_quorum(quorum_id, gone, latest, want):
    assert gone_in_quorum(quorum_id, gone, latest) == want


def breaks(script: list[tuple], keep: int = 16) -> list[tuple[str, ...] | None]:
    b = StepBreaks(keep)
    out: list[tuple[str, ...] | None] = []
    for event, *args in script:
        if event == "notice":
            out.append(b.notice(args[0], tuple(args[1])))
        elif event == "step":
            b.step_started()
        elif event == "applied":
            out.append(b.quorum_applied(args[0]))
    return out


@pytest.mark.parametrize(
    "script, want",
    [
        # The notice names this step's quorum: abort now.
        ([("step",), ("applied", 7), ("notice", 7, "c")], [None, ("c",)]),
        # Another quorum's notice: nothing now, nor when that id is not applied.
        ([("step",), ("applied", 8), ("notice", 7, "c"), ("step",), ("applied", 9)],
         [None, None, None]),
        # A notice before the step's quorum is applied: abort when it is.
        ([("step",), ("notice", 7, "c"), ("applied", 7)], [None, ("c",)]),
        # Between steps (after the vote, before the next quorum): remembered.
        ([("step",), ("applied", 7), ("step",), ("notice", 7, "c"), ("applied", 7)],
         [None, None, ("c",)]),
    ],
)  # fmt: skip
def test_step_breaks(script, want):
    assert breaks(script) == want


def test_step_breaks_remember_a_bounded_number_of_quorums():
    got = breaks([("notice", q, "c") for q in range(5)] + [("applied", 0), ("applied", 4)], keep=3)
    assert got[-2:] == [None, ("c",)]


@pytest.mark.parametrize(
    "script, want",
    [
        # The usual order: the quorum, then a notice about it.
        ([("applied", 7, ("a", "b")), ("heard", 7, ("b",))], [(), ("b",)]),
        # The notice first (the quorum's answer still on its way): kept, then passed on.
        ([("heard", 7, ("b",)), ("applied", 7, ("a", "b"))], [(), ("b",)]),
        # About another quorum, or naming no member of ours: nothing, now or later.
        ([("applied", 7, ("a", "b")), ("heard", 6, ("b",)), ("heard", 7, ("z",))], [(), (), ()]),
        ([("heard", 8, ("z",)), ("applied", 8, ("a", "b"))], [(), ()]),
        # Kept only for a later quorum of ours: an early notice about 9 does not reach 8.
        ([("heard", 9, ("b",)), ("applied", 8, ("a", "b")), ("applied", 9, ("a", "b"))],
         [(), (), ("b",)]),
        # A group that took in its view knows no members: the lighthouse names
        # only its quorum's, so every name counts; another quorum still not.
        ([("applied", 7, None), ("heard", 7, ("z", "b")), ("heard", 6, ("c",))],
         [(), ("b", "z"), ()]),
        ([("heard", 7, ("b",)), ("applied", 7, None)], [(), ("b",)]),
    ],
)  # fmt: skip
def test_group_notices_pass_on_what_concerns_the_latest_quorum_even_if_early(script, want):
    notices = GroupNotices(keep=4)
    got = []
    for event, quorum_id, ids in script:
        if event == "applied":
            got.append(notices.applied(quorum_id, ids))
        else:
            got.append(notices.heard(quorum_id, ids))
    assert got == want


def test_group_notices_keep_only_a_few_early_ones():
    notices = GroupNotices(keep=2)
    for quorum_id in (1, 2, 3):
        notices.heard(quorum_id, ("b",))
    assert notices.applied(1, ("a", "b")) == ()  # the oldest was let go
    assert notices.applied(3, ("a", "b")) == ("b",)
