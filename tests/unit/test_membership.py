"""The lighthouse's membership: events in, effects out, time passed in.

Each case plays a short script of events on a fresh Membership and checks
what the last event leads to: the calling RPC's refusal and every effect,
each written as a short line (see `describe`), log lines and reasons
included. No server, no event loop, no sockets.
"""

from __future__ import annotations

import logging

import pytest

from lighthouse.core.compat import HANDLES_FIELD
from lighthouse.core.effects import (
    AdviceChanged,
    DecideSoon,
    Effect,
    Fail,
    Forgotten,
    Handed,
    Issued,
    Joined,
    JudgeGoneSoon,
    Log,
    Outcome,
    Placed,
    TwinRefused,
)
from lighthouse.core.gone import Gone
from lighthouse.core.membership import Membership
from lighthouse.core.quorum import LighthouseConfig, QuorumMember

CONFIG = LighthouseConfig(
    min_replicas=2, join_timeout_ms=10_000, heartbeat_timeout_ms=1000, suspect_phi=0
)
WALL = 1_000_000.0
"""Wall clock minus monotonic clock in these scripts."""
# A torchft nightly member: reconfigure handles in field 9 (lighthouse.core.compat).
HANDLES = bytes([(HANDLES_FIELD << 3) | 2, 1]) + b"h"


def play(script: list[tuple[object, ...]]) -> tuple[Membership, Outcome]:
    """Plays (event, now, args...) tuples; returns the membership and the last outcome."""
    m = Membership(CONFIG, started_at=0.0)
    outcome = Outcome()
    for event, now, *args in script:
        assert isinstance(now, float)
        if event == "heartbeat":
            outcome = m.heartbeat(now, str(args[0]))
        elif event == "join":
            rid, step = str(args[0]), int(args[1]) if len(args) > 1 else 0
            raw = HANDLES if len(args) > 2 else b""
            outcome = m.join(now, QuorumMember(rid, step=step, unknown_fields=raw))
        elif event == "withdraw":
            m.withdraw(str(args[0]), int(args[1]))
            outcome = Outcome()
        elif event == "leave":
            outcome = m.leave(now, now + WALL, str(args[0]))
        elif event == "open":
            m.stream_opened(str(args[0]))
            outcome = Outcome()
        elif event == "end":
            outcome = m.stream_ended(now, str(args[0]))
        elif event == "tick":
            outcome = m.tick(now, now + WALL)
        elif event == "decide":
            outcome = m.decide(now, now + WALL)
        elif event == "judge":
            outcome = m.judge_gone(now)
        elif event == "spare":
            outcome = m.spare_waits(now, str(args[0]), str(args[1]) if len(args) > 1 else "")
        else:
            raise AssertionError(f"no event {event!r}")
    return m, outcome


def describe(effect: Effect) -> str:
    if isinstance(effect, Fail):
        return f"fail #{effect.ticket} {type(effect.error).__name__}: {effect.error}"
    if isinstance(effect, Issued):
        ids = ",".join(effect.quorum.replica_ids())
        absent = "".join(f" [{rid}: {why}]" for rid, why in sorted(effect.absent.items()))
        news = " news" if effect.news else ""
        return f"issue {ids} to #{effect.tickets}{news}: {effect.reason}{absent}"
    if isinstance(effect, Placed):
        return f"place #{effect.ticket} as {effect.group}"
    if isinstance(effect, Handed):
        return f"hand {effect.group} to {effect.spare_id}" + (
            " (promotion)" if effect.promotion else ""
        )
    if isinstance(effect, Joined):
        return f"joined {effect.member.replica_id}"
    if isinstance(effect, Forgotten):
        return f"forget {effect.replica_id}: {effect.why}"
    if isinstance(effect, TwinRefused):
        return f"twin {effect.replica_id}"
    if isinstance(effect, AdviceChanged):
        return f"advice {effect.advice_ms}"
    if isinstance(effect, DecideSoon):
        return "decide now" if effect.now else "decide soon"
    if isinstance(effect, JudgeGoneSoon):
        return "judge gone soon"
    if isinstance(effect, Gone):
        n = effect.notice
        return f"gone {','.join(n.gone)} of {n.quorum_id} -> {','.join(n.recipients)}"
    assert isinstance(effect, Log)
    return f"{logging.getLevelName(effect.level)} {effect.msg % effect.args}"


TWO_WAITING = [("heartbeat", 0.0, "g0:a"), ("heartbeat", 0.0, "g1:b"), ("join", 0.1, "g0:a")]
STALLED = [("join", 0.0, "a"), ("heartbeat", 4.9, "a"), ("heartbeat", 4.9, "b"), ("decide", 5.0)]
"""a has waited 5 s for b: a stall (lighthouse.core.quorum_log)."""
AB_QUORUM = [("join", 0.0, "a"), ("join", 0.0, "b"), ("decide", 0.0)]
"""Quorum 1000000000 of a and b (lighthouse.core.gone's notices are about it)."""
B_SILENT = AB_QUORUM + [("heartbeat", 1.05, "a"), ("tick", 1.1)]
"""b silent past the heartbeat timeout while a heartbeats."""


@pytest.mark.parametrize(
    "script, error, effects",
    [
        # -- heartbeats and twins --
        ([("heartbeat", 0.0, "g0:a")], None, []),
        (
            [("heartbeat", 0.0, "g0:a"), ("heartbeat", 0.1, "g0:b")],
            "replica group 'g0' is already live as g0:a",
            ["WARNING refused: replica group 'g0' is already live as g0:a", "twin g0:b"],
        ),
        # A twin's later heartbeats are refused too, but logged once.
        (
            [("heartbeat", 0.0, "g0:a"), ("heartbeat", 0.1, "g0:b"), ("heartbeat", 0.2, "g0:b")],
            "refusing g0:b: a group id must be unique",
            [],
        ),
        # The name frees up when its holder's stream closes...
        (
            [("heartbeat", 0.0, "g0:a"), ("open", 0.0, "g0:a"), ("end", 0.1, "g0:a"),
             ("heartbeat", 0.2, "g0:b")],
            None, [],
        ),
        # ...when it is silent past the heartbeat timeout, or when it leaves.
        ([("heartbeat", 0.0, "g0:a"), ("heartbeat", 1.5, "g0:b")], None, []),
        ([("heartbeat", 0.0, "g0:a"), ("leave", 0.1, "g0:a"), ("join", 0.2, "g0:b")],
         None, ["joined g0:b", "decide soon"]),
        # A twin's Quorum call is refused before it waits.
        (
            [("heartbeat", 0.0, "g0:a"), ("join", 0.1, "g0:b")],
            "already live as g0:a",
            ["WARNING refused", "twin g0:b"],
        ),
        # -- heartbeat streams --
        # A reconnect overlaps the old stream: the old one ending is no death.
        ([("heartbeat", 0.0, "a"), ("open", 0.0, "a"), ("open", 0.1, "a"), ("end", 0.2, "a")],
         None, []),
        (
            [("heartbeat", 0.0, "a"), ("open", 0.0, "a"), ("end", 0.2, "a")],
            None,
            ["INFO replica a: heartbeat stream closed; unhealthy until it heartbeats again",
             "judge gone soon"],
        ),
        # A stream ending after a Leave: the replica is already forgotten.
        ([("heartbeat", 0.0, "a"), ("open", 0.0, "a"), ("leave", 0.1, "a"), ("end", 0.2, "a")],
         None, []),
        # A death with callers waiting re-decides soon.
        (
            TWO_WAITING + [("open", 0.1, "g1:b"), ("end", 0.2, "g1:b")],
            None,
            ["INFO replica g1:b: heartbeat stream closed", "judge gone soon", "decide soon"],
        ),
        # -- Quorum calls --
        (TWO_WAITING, None, ["joined g0:a", "decide soon"]),
        # Every replica heard of (and min_replicas) waits: nothing to batch.
        (TWO_WAITING + [("join", 0.1, "g1:b")], None, ["joined g1:b", "decide now"]),
        (
            TWO_WAITING + [("decide", 0.1)],
            None,
            ["DEBUG quorum status: waiting for replicas: 1 joined, min_replicas is 2"],
        ),
        (
            TWO_WAITING + [("join", 0.2, "g1:b"), ("decide", 0.2)],
            None,
            ["issue g0:a,g1:b to #(1, 2) news: every healthy replica joined "
             "[2/2 participants healthy]"],
        ),
        # A second call of one replica supersedes the first.
        (
            [("join", 0.0, "a"), ("join", 0.1, "a")],
            None,
            ["joined a", "fail #1 QuorumError: replica a called Quorum again; this call is "
             "superseded", "decide soon"],
        ),
        # A call that ended is not put into a quorum (a stale ticket changes nothing).
        (
            [("join", 0.0, "a"), ("join", 0.0, "b"), ("withdraw", 0.0, "b", 2),
             ("withdraw", 0.0, "a", 9), ("decide", 0.1)],
            None,
            ["DEBUG quorum status: waiting for replicas: 1 joined, min_replicas is 2"],
        ),
        # A replica that leaves ends its own call and re-decides at once.
        (
            TWO_WAITING + [("join", 0.1, "g1:b"), ("leave", 0.2, "g1:b")],
            None,
            ["INFO replica g1:b left", "forget g1:b: left on purpose (Leave)",
             "fail #2 QuorumError: replica g1:b left",
             "DEBUG quorum status: waiting for replicas: 1 joined"],
        ),
        # The next quorum says why a previous member is absent.
        (
            [("join", 0.0, "a"), ("join", 0.0, "b"), ("join", 0.0, "c"), ("decide", 0.0),
             ("leave", 0.1, "c"), ("join", 0.2, "a"), ("join", 0.2, "b"), ("decide", 0.2)],
            None,
            ["issue a,b to #(4, 5) news: every healthy replica joined [2/2 participants healthy]"
             " [c: left on purpose (Leave)]"],
        ),
        # The same members again: no news, no absent list.
        (
            [("join", 0.0, "a"), ("join", 0.0, "b"), ("decide", 0.0),
             ("join", 0.2, "a"), ("join", 0.2, "b"), ("decide", 0.2)],
            None,
            ["issue a,b to #(3, 4): fast quorum: every previous member joined"],
        ),
        # A torchft nightly beside store-rendezvous groups is refused with the reason.
        (
            [("join", 0.0, "a"), ("join", 0.0, "b"), ("join", 0.0, "h", 0, "handles"),
             ("decide", 0.1)],
            None,
            ["WARNING refusing h: replica h speaks torchft's reconfigure-handle rendezvous",
             "fail #3 IncompatibleGroupError: replica h speaks torchft's reconfigure-handle",
             "issue a,b to #(1, 2) news: every healthy replica joined [2/2 participants "
             "healthy][1 refused, another rendezvous: h]"],
        ),
        # A stall is logged at INFO once, then the quorum that ends it is news.
        (
            STALLED,
            None,
            ["INFO quorum status: stalled for 5 s: waiting for replicas: 1 joined"],
        ),
        (STALLED + [("decide", 5.1)], None, []),
        (
            STALLED + [("join", 5.2, "b"), ("decide", 5.2)],
            None,
            ["issue a,b to #(1, 2) news: every healthy replica joined"],
        ),
        # -- ticks: forgetting and pacing --
        (
            [("heartbeat", 0.0, "a"), ("join", 0.0, "b"), ("tick", 61.0)],
            None,
            ["INFO forgetting replica a: silent for over 60 s",
             "forget a: forgotten: silent over 60 s",
             "INFO quorum status: stalled for 61 s: waiting for replicas: 0 joined"],
        ),
        (
            [("heartbeat", 0.0, f"r{i}") for i in range(150)] + [("tick", 0.1)],
            None,
            ["advice 200"],
        ),
        # -- gone members of the latest quorum (lighthouse.core.gone) --
        # A member's stream closes: judged in the server's next turn (once
        # for every stream that ends meanwhile), and the others hear of it.
        (
            AB_QUORUM + [("open", 0.0, "b"), ("end", 0.5, "b")],
            None,
            ["INFO replica b: heartbeat stream closed", "judge gone soon"],
        ),
        (
            AB_QUORUM + [("open", 0.0, "b"), ("end", 0.5, "b"), ("judge", 0.5)],
            None,
            ["INFO quorum 1000000000: members gone (b: heartbeat stream closed (process or "
             "connection gone)); telling a to abort the collectives they share with them",
             "gone b of 1000000000 -> a"],
        ),
        # Silent past the heartbeat timeout: the tick tells, once.
        (B_SILENT, None, ["INFO quorum 1000000000: members gone (b: silent 1.1 s",
                          "gone b of 1000000000 -> a"]),
        (B_SILENT + [("heartbeat", 1.15, "a"), ("tick", 1.2)], None, []),
        # b heard from again (SIGCONT): told that it is gone from that quorum.
        (B_SILENT + [("heartbeat", 1.2, "b")], None, ["gone b of 1000000000 -> b"]),
        # A member that leaves is gone too; a non-member leaving is no news.
        (AB_QUORUM + [("leave", 0.5, "b")],
         None, ["INFO replica b left", "forget b", "INFO quorum 1000000000: members gone "
                "(b: left or forgotten)", "gone b of 1000000000 -> a"]),
        (AB_QUORUM + [("heartbeat", 0.1, "z"), ("leave", 0.5, "z")],
         None, ["INFO replica z left", "forget z"]),
        # The next quorum has a new id even with the same members: no notice
        # can name a later quorum's collectives.
        (
            B_SILENT + [("heartbeat", 1.2, "b"), ("join", 1.3, "a"), ("join", 1.3, "b"),
                        ("decide", 1.3)],
            None,
            ["issue a,b to #(3, 4) news: fast quorum: every previous member joined"],
        ),
        # -- spares --
        ([("spare", 0.0, "")], "spare_id must be a non-empty string", []),
        # A group's first start takes its own name.
        ([("spare", 0.0, "s", "g0")], None, ["hand g0 to s", "place #1 as g0"]),
        # A spare waits while every group lives, and takes the first that dies.
        (
            [("heartbeat", 0.0, "g0:a"), ("open", 0.0, "g0:a"), ("spare", 0.1, "s")],
            None,
            [],
        ),
        (
            [("heartbeat", 0.0, "g0:a"), ("open", 0.0, "g0:a"), ("spare", 0.1, "s"),
             ("end", 0.2, "g0:a")],
            None,
            ["INFO replica g0:a: heartbeat stream closed", "judge gone soon",
             "hand g0 to s (promotion)",
             "place #1 as g0"],
        ),
        # The group handed out is reserved: a second spare does not get it...
        (
            [("heartbeat", 0.0, "g0:a"), ("heartbeat", 0.0, "g1:b"), ("tick", 2.0),
             ("spare", 2.0, "s1"), ("spare", 2.0, "s2")],
            None,
            ["hand g1 to s2 (promotion)", "place #2 as g1"],
        ),
        # ...but another rank of the same spare does.
        (
            [("heartbeat", 0.0, "g0:a"), ("tick", 2.0), ("spare", 2.0, "s"),
             ("spare", 2.1, "s")],
            None,
            ["place #2 as g0"],
        ),
        # The reservation ends when a replica of the group heartbeats, and
        # the group lives: the next spare waits.
        (
            [("heartbeat", 0.0, "g0:a"), ("tick", 2.0), ("spare", 2.0, "s1"),
             ("heartbeat", 2.1, "g0:new"), ("spare", 2.2, "s2")],
            None,
            [],
        ),
    ],
)  # fmt: skip
def test_each_event_leads_to_its_effects(script, error, effects):
    _, outcome = play(script)
    if error is None:
        assert outcome.error is None
    else:
        assert outcome.error is not None and error in str(outcome.error)
    got = [describe(e) for e in outcome.effects]
    assert len(got) == len(effects), got
    for line, prefix in zip(got, effects):
        assert line.startswith(prefix), (line, prefix)


def test_a_quorum_id_is_at_least_the_wall_clock_in_milliseconds():
    _, outcome = play([("join", 0.0, "a"), ("join", 0.0, "b"), ("decide", 0.5)])
    (issued,) = outcome.effects
    assert isinstance(issued, Issued)
    assert issued.quorum.quorum_id == int((0.5 + WALL) * 1000)
    assert issued.quorum.created == 0.5 + WALL


def test_callers_left_out_of_a_quorum_start_their_join_timeout_over():
    # c waits, then falls silent past the heartbeat timeout: left out of a, b's quorum.
    m, outcome = play([("join", 0.0, "c"), ("join", 1.2, "a"), ("join", 1.2, "b"), ("decide", 1.5)])
    assert describe(outcome.effects[-1]).startswith("issue a,b to #(2, 3) news")
    assert {rid: p.joined_at for rid, p in m.participants.items()} == {"c": 1.5}
    assert m.tickets == {"c": 1}


def test_a_replica_is_healthy_again_with_its_next_heartbeat_after_its_stream_closed():
    m, _ = play([("heartbeat", 0.0, "a"), ("open", 0.0, "a"), ("end", 0.1, "a")])
    assert m.healthy(0.2) == set()
    m.heartbeat(0.3, "a")
    assert m.healthy(0.4) == {"a"}


def test_the_waiting_spares_count_each_spare_once():
    m, _ = play([("heartbeat", 0.0, "g0:a"), ("spare", 0.1, "s"), ("spare", 0.1, "s")])
    assert m.num_spares_waiting() == 1
    m.spare_ends(1)
    m.spare_ends(2)
    assert m.num_spares_waiting() == 0


def test_a_tick_told_not_to_decide_leaves_the_waiting_calls_to_a_later_one():
    """The server paces decisions by their cost (Coordinator.tick)."""
    m, _ = play([("join", 0.0, "a"), ("join", 0.0, "b")])
    assert not any(isinstance(e, Issued) for e in m.tick(0.1, 0.1 + WALL, decide=False).effects)
    assert set(m.participants) == {"a", "b"}
    issued = [e for e in m.tick(0.2, 0.2 + WALL).effects if isinstance(e, Issued)]
    assert [e.quorum.replica_ids() for e in issued] == [("a", "b")]


def test_num_healthy_counts_as_healthy_does_through_timeouts_closed_streams_and_returns():
    # Heartbeat times, a closed stream and a return, checked at times around
    # the timeouts (1 s): the count kept from deadlines must equal the scan.
    # (Exactly at a deadline the two round differently: `last + 1 > now` is
    # not `now - last < 1` in floats; a tick decides either way.)
    m = Membership(CONFIG, 0.0)
    for rid, at in (("a", 0.0), ("b", 0.2), ("c", 0.5), ("d", 0.85)):
        m.heartbeat(at, rid)
    m.stream_opened("c")
    m.stream_ended(0.6, "c")
    checks = [0.95, 0.999, 1.001, 1.19, 1.21, 1.5, 1.89]
    for now in checks:
        assert m.num_healthy(now) == len(m.healthy(now)), now
    m.heartbeat(1.9, "a")  # back after timing out
    m.heartbeat(1.9, "c")  # heard again after its stream closed
    for now in (1.9, 1.901, 2.5, 2.899, 2.901, 3.0):
        assert m.num_healthy(now) == len(m.healthy(now)), now
    m.tick(40.0, WALL + 40.0, False)  # everyone forgotten
    assert m.num_healthy(40.0) == len(m.healthy(40.0)) == 0
