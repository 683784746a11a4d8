"""The chaos runner's pure parts: the seeded fault schedule and the checks
computed from the per-step logs."""

from __future__ import annotations

from collections import Counter

import pytest

from tools.chaos.checks import (
    StepRecord,
    committed_step_regressions,
    final_agreement,
    first_commit_after,
    goodput,
    step_regressions,
    survivor_stall_s,
)
from tools.chaos.schedule import (
    ALL_KINDS,
    BASIC_KINDS,
    CORRELATED_KINDS,
    TWO_GROUP_KINDS,
    Fault,
    FaultKind,
    ScheduleConfig,
    make_schedule,
    parse_kinds,
)

K = FaultKind


def config(**overrides) -> ScheduleConfig:
    base = dict(num_groups=3, nproc_per_group=2, num_steps=100, num_faults=8, seed=0)
    return ScheduleConfig(**{**base, **overrides})


# ---- schedule ------------------------------------------------------------------


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    assert make_schedule(config(seed=7)) == make_schedule(config(seed=7))
    assert make_schedule(config(seed=7)) != make_schedule(config(seed=8))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"num_faults": 1},
        {"num_faults": 300, "num_steps": 3000},
        {"warmup_steps": 30, "tail_steps": 50},
        {"num_groups": 2, "nproc_per_group": 1},
    ],
)
def test_faults_lie_between_warmup_and_tail_in_step_order_with_delays_in_range(overrides):
    cfg = config(**overrides)
    faults = make_schedule(cfg)
    assert len(faults) == cfg.num_faults
    steps = [f.at_step for f in faults]
    assert steps == sorted(steps)
    assert all(cfg.warmup_steps <= s < cfg.num_steps - cfg.tail_steps for s in steps)
    assert all(cfg.min_delay_s <= f.delay_s <= cfg.max_delay_s for f in faults)


@pytest.mark.parametrize(
    "kinds, num_faults, expected",
    [
        (ALL_KINDS, 4, {k: 1 for k in ALL_KINDS}),
        (ALL_KINDS, 8, {k: 2 for k in ALL_KINDS}),
        ((K.KILL_GROUP, K.KILL_RANK, K.KILL_GROUP, K.RESTART_LIGHTHOUSE), 4,
         {K.KILL_GROUP: 2, K.KILL_RANK: 1, K.RESTART_LIGHTHOUSE: 1}),
        ((K.STOP_GROUP,), 5, {K.STOP_GROUP: 5}),
    ],
)  # fmt: skip
def test_kinds_are_cycled_so_a_list_as_long_as_the_faults_gives_each_once(
    kinds, num_faults, expected
):
    faults = make_schedule(config(kinds=kinds, num_faults=num_faults))
    assert Counter(f.kind for f in faults) == expected


@pytest.mark.parametrize("seed", range(5))
def test_victims_exist_and_only_rank_kills_name_a_rank(seed):
    cfg = config(seed=seed, num_faults=40, num_steps=400)
    for f in make_schedule(cfg):
        if f.kind == K.RESTART_LIGHTHOUSE:
            assert f.group is None and f.rank is None
        else:
            assert 0 <= f.group < cfg.num_groups
            assert (f.rank is not None) == (f.kind == K.KILL_RANK)
            assert f.rank is None or 0 <= f.rank < cfg.nproc_per_group


def test_a_rank_kill_in_single_rank_groups_is_a_group_kill():
    faults = make_schedule(config(nproc_per_group=1, kinds=(K.KILL_RANK,), num_faults=3))
    assert {f.kind for f in faults} == {K.KILL_GROUP}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_groups": 0}, r"num_groups \(0\) must be at least 1"),
        ({"num_faults": -1}, r"num_faults \(-1\) must be 0 or more"),
        ({"num_groups": 1}, r"num_groups \(1\) must be at least 2 to fault a group"),
        ({"kinds": ()}, "kinds is empty"),
        ({"min_delay_s": 2.0, "max_delay_s": 1.0}, "min_delay_s <= max_delay_s"),
        ({"warmup_steps": 60, "tail_steps": 40}, r"must be below num_steps \(100\)"),
    ],
)
def test_bad_configs_are_refused_naming_the_value_and_the_rule(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


def test_one_group_may_see_lighthouse_restarts_only():
    cfg = config(num_groups=1, kinds=(K.RESTART_LIGHTHOUSE,))
    assert all(f.group is None for f in make_schedule(cfg))


def test_kinds_parse_from_a_comma_list_and_unknown_names_are_refused():
    assert parse_kinds("kill_group, stop_group") == (K.KILL_GROUP, K.STOP_GROUP)
    with pytest.raises(ValueError, match="unknown fault kind 'nap'; use a comma list of"):
        parse_kinds("kill_group,nap")


def test_a_seed_of_the_basic_kinds_draws_what_it_drew_before_the_correlated_kinds_came():
    # Replays of older runs: these are the schedules the seeds gave then.
    assert ALL_KINDS == BASIC_KINDS and config().kinds == BASIC_KINDS
    assert make_schedule(config(num_faults=6, seed=0)) == [
        Fault(13, K.STOP_GROUP, 1, None, 1.778),
        Fault(32, K.KILL_GROUP, 1, None, 2.575),
        Fault(37, K.KILL_RANK, 0, 0, 2.729),
        Fault(48, K.RESTART_LIGHTHOUSE, None, None, 2.39),
        Fault(60, K.KILL_RANK, 2, 1, 2.325),
        Fault(73, K.KILL_GROUP, 1, None, 0.752),
    ]
    assert make_schedule(config(num_faults=6, seed=1))[3] == Fault(50, K.KILL_RANK, 0, 1, 2.406)


# ---- correlated kinds ------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_groups, nproc", [(3, 1), (3, 2), (4, 2), (5, 3)])
def test_correlated_kinds_pick_distinct_victims_and_never_every_group(seed, num_groups, nproc):
    cfg = config(
        seed=seed, num_groups=num_groups, nproc_per_group=nproc, num_faults=40,
        num_steps=400, kinds=CORRELATED_KINDS,
    )  # fmt: skip
    for f in make_schedule(cfg):
        assert all(0 <= g < num_groups for g in f.groups)
        assert len(set(f.groups)) == len(f.groups), f"a group drawn twice: {f}"
        assert len(f.groups) < num_groups, f"no survivor: {f}"
        assert len(f.groups) == (2 if f.kind in TWO_GROUP_KINDS else 1)
        assert (f.second_group is not None) == (f.kind in TWO_GROUP_KINDS)
        assert set(f.ranks) == (set(f.groups) if f.kind == K.KILL_RANK_PAIR else set())
        assert all(0 <= r < nproc for r in f.ranks.values())
        assert f.hits_lighthouse == (f.kind == K.RESTART_LIGHTHOUSE_IN_HEAL)


@pytest.mark.parametrize(
    "fault, victims",
    [
        (Fault(20, K.KILL_TWO_GROUPS, 2, None, 1.0, second_group=0), "g2+g0"),
        (Fault(20, K.KILL_IN_RECONFIGURE, 0, None, 1.0, second_group=1), "g0+g1"),
        (Fault(20, K.KILL_RANK_PAIR, 1, 0, 1.0, second_group=2, second_rank=1), "g1/r0+g2/r1"),
        (Fault(20, K.RESTART_LIGHTHOUSE_IN_HEAL, 1, None, 1.0), "g1+lighthouse"),
        (Fault(20, K.RESTART_LIGHTHOUSE, None, None, 1.0), "lighthouse"),
        (Fault(20, K.KILL_RANK, 2, 1, 1.0), "g2/r1"),
    ],
)
def test_each_fault_names_its_victims_the_first_first(fault, victims):
    assert fault.victims() == victims


def test_correlated_schedules_are_seeded():
    cfg = dict(kinds=CORRELATED_KINDS, num_faults=40, num_steps=400)
    assert make_schedule(config(seed=3, **cfg)) == make_schedule(config(seed=3, **cfg))
    assert make_schedule(config(seed=3, **cfg)) != make_schedule(config(seed=4, **cfg))


@pytest.mark.parametrize(
    "kinds, num_faults, expected",
    [
        (CORRELATED_KINDS, 4, {k: 1 for k in CORRELATED_KINDS}),
        (CORRELATED_KINDS, 12, {k: 3 for k in CORRELATED_KINDS}),
        ((K.KILL_GROUP, K.KILL_TWO_GROUPS), 4, {K.KILL_GROUP: 2, K.KILL_TWO_GROUPS: 2}),
    ],
)
def test_correlated_kinds_are_cycled_like_the_others(kinds, num_faults, expected):
    faults = make_schedule(config(kinds=kinds, num_faults=num_faults))
    assert Counter(f.kind for f in faults) == expected


def test_a_rank_pair_kill_in_single_rank_groups_is_a_two_group_kill():
    cfg = config(nproc_per_group=1, kinds=(K.KILL_RANK_PAIR,), num_faults=3)
    faults = make_schedule(cfg)
    assert {f.kind for f in faults} == {K.KILL_TWO_GROUPS}
    assert all(f.rank is None and f.second_rank is None for f in faults)


@pytest.mark.parametrize("kind", sorted(TWO_GROUP_KINDS))
@pytest.mark.parametrize("num_groups", [1, 2])
def test_two_group_kinds_need_three_groups(kind, num_groups):
    with pytest.raises(ValueError, match=rf"num_groups \({num_groups}\) must be at least 3 for "
                       rf"{kind.value}: two groups go down at once"):  # fmt: skip
        config(num_groups=num_groups, kinds=(K.KILL_GROUP, kind))


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_groups": 3, "kinds": CORRELATED_KINDS},
        {"num_groups": 2, "kinds": (K.RESTART_LIGHTHOUSE_IN_HEAL, K.KILL_GROUP)},
        {"num_groups": 2, "kinds": CORRELATED_KINDS, "num_faults": 0},
    ],
)
def test_correlated_configs_that_leave_a_survivor_are_accepted(overrides):
    config(**overrides)


def test_a_heal_needs_a_second_group_to_heal_from():
    with pytest.raises(ValueError, match=r"num_groups \(1\) must be at least 2"):
        config(num_groups=1, kinds=(K.RESTART_LIGHTHOUSE_IN_HEAL,))


def test_correlated_kinds_parse_by_name():
    text = "kill_two_groups,kill_in_reconfigure,kill_rank_pair,restart_lighthouse_in_heal"
    assert parse_kinds(text) == CORRELATED_KINDS
    with pytest.raises(ValueError, match="restart_lighthouse_in_heal"):
        parse_kinds("kill_three_groups")


# ---- checks --------------------------------------------------------------------


def rec(group, t, step, committed=True, participants=2, incarnation=0, quorum=-1) -> StepRecord:
    return StepRecord(group, incarnation, t, step, committed, participants, quorum)


@pytest.mark.parametrize(
    "records, num_problems",
    [
        ([rec(0, 1, 1), rec(0, 2, 2), rec(0, 3, 2, committed=False)], 0),
        ([rec(0, 1, 5), rec(0, 2, 4)], 1),
        # a restarted group counts from 0 again in its new incarnation
        ([rec(0, 1, 5), rec(0, 2, 1, incarnation=1), rec(0, 3, 6, incarnation=1)], 0),
        ([rec(0, 1, 5), rec(1, 2, 1)], 0),
    ],
)
def test_a_step_going_back_within_one_incarnation_is_a_problem(records, num_problems):
    assert len(step_regressions(records)) == num_problems


@pytest.mark.parametrize(
    "records, num_problems",
    [
        # one quorum: a member logs step 4 just after the other logged 5
        ([rec(0, 1, 4), rec(0, 2, 5), rec(1, 2.1, 4), rec(1, 2.2, 5)], 0),
        # a group trained alone from scratch while the job was at step 50
        ([rec(0, 1, 50), rec(1, 2, 1), rec(1, 3, 2)], 2),
        # an uncommitted step behind the job is fine (a healing replica)
        ([rec(0, 1, 50), rec(1, 2, 3, committed=False), rec(1, 3, 51)], 0),
        # seed 17: group 2 was stopped between its allreduce of step 100 and its
        # log line; groups 0 and 1 went on in quorum 8 without it, and group 2
        # logged its commit (in quorum 7) 2.4 s late
        ([rec(0, 10.0, 100, quorum=7), rec(1, 10.0, 100, quorum=7),
          rec(0, 11.0, 101, quorum=8), rec(1, 11.0, 101, quorum=8),
          rec(0, 12.0, 102, quorum=8), rec(1, 12.1, 102, quorum=8),
          rec(2, 12.4, 100, quorum=7), rec(0, 13.0, 103, quorum=8)], 0),
        # a later quorum really committing below an earlier one is still caught
        ([rec(0, 1, 50, quorum=7), rec(1, 2, 1, quorum=8), rec(1, 3, 2, quorum=8)], 2),
    ],
)  # fmt: skip
def test_the_highest_committed_step_never_goes_backwards(records, num_problems):
    assert len(committed_step_regressions(records)) == num_problems


def fin(step, hash_, quorum) -> dict:
    return {"step": step, "hash": hash_, "quorum_id": quorum}


@pytest.mark.parametrize(
    "finals, outside, num_problems",
    [
        ({0: fin(60, "a", 7), 1: fin(60, "a", 7), 2: fin(60, "a", 7)}, [], 0),
        ({0: fin(60, "a", 7), 1: fin(60, "b", 7), 2: fin(60, "a", 7)}, [], 1),
        ({0: fin(60, "a", 7), 1: fin(61, "a", 7)}, [], 1),
        # a group that ended in another quorum trained alone: reported, not compared
        ({0: fin(60, "a", 7), 1: fin(60, "a", 7), 2: fin(60, "z", 9)}, [2], 0),
        ({}, [], 1),
    ],
)
def test_groups_of_the_last_quorum_must_end_bit_identical(finals, outside, num_problems):
    got_outside, problems = final_agreement(finals)
    assert got_outside == outside and len(problems) == num_problems


def test_goodput_counts_participants_per_committed_step_against_a_fault_free_rate():
    # two groups, 1 s per step; group 1 misses steps 3 and 4 (its commits absent)
    records = [rec(0, t, t, participants=2) for t in (1, 2)]
    records += [rec(1, t, t, participants=2) for t in (1, 2)]
    records += [rec(0, t, t, participants=1) for t in (3, 4)]
    records += [rec(0, t, t, participants=2) for t in (5, 6)]
    records += [rec(1, t, t, participants=2) for t in (5, 6)]
    g = goodput(records, num_groups=2, num_steps=6)
    assert g.participant_steps == 10
    assert g.participation == pytest.approx(10 / 12)
    assert g.fault_free_step_s == pytest.approx(1.0)
    assert g.goodput == pytest.approx(10 / 12)


def test_survivor_stall_is_the_longest_commit_gap_around_the_fault():
    records = [rec(0, t, i) for i, t in enumerate([1.0, 2.0, 6.0, 7.0, 8.0, 20.0], 1)]
    records.append(rec(1, 3.0, 3))  # the victim's commits do not count
    assert survivor_stall_s(records, [0], start=2.5, end=7.5) == pytest.approx(4.0)
    # the first commit after the settle point closes the window
    assert survivor_stall_s(records, [0], start=8.5, end=9.0) == pytest.approx(12.0)


def test_first_commit_after_ignores_uncommitted_steps_and_other_groups():
    records = [rec(0, 1, 1), rec(1, 2, 1, committed=False), rec(1, 3, 2), rec(0, 4, 3)]
    assert first_commit_after(records, [1], 1.5) == 3
    assert first_commit_after(records, [1], 3) is None
