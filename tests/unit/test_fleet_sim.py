"""The fleet simulation (bench.fleet_sim): a seeded failure model, a virtual
clock that only events move, and small fleets whose outcome is exact."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from bench._fleet_engine import Fleet, FleetConfig, state_memory_bytes
from bench._fleet_model import FAULT_FREE, FailureModel, failure_schedule
from bench.fleet_sim import goodput, keeping_up, quantile

EXACT = FleetConfig(
    n_groups=3,
    seconds=16.0,
    warmup_s=0.0,
    step_s=1.0,
    step_jitter=0.0,
    join_spread_s=0.0,
    start_spread_s=0.0,
    restart_s=10.0,
    abort_s=0.5,
    measured_pacing=False,
)
"""Three groups, 1 s steps, no jitter: every event falls on a known time."""


def exact_fleet(config: FleetConfig = EXACT, kill: float | None = None) -> Fleet:
    """The fleet of `config`, with group 1 failing at virtual time `kill`."""
    fleet = Fleet(config, clock=itertools.count().__next__)  # a fake cost clock: no time read
    if kill is not None:
        fleet.at(kill, "fail", (1,))
    return fleet


@pytest.mark.parametrize("dist", ["exp", "weibull"])
def test_the_failure_model_is_seeded_and_reproducible(dist: str) -> None:
    model = FailureModel(group_mtbf_s=600.0, dist=dist, rack_size=4, rack_mtbf_s=900.0)
    first = failure_schedule(model, seed=7, n_groups=40, horizon_s=600.0)
    assert first == failure_schedule(model, seed=7, n_groups=40, horizon_s=600.0)
    assert first != failure_schedule(model, seed=8, n_groups=40, horizon_s=600.0)
    assert [f.at for f in first] == sorted(f.at for f in first)
    assert all(0 <= f.at < 600.0 for f in first)
    racks = [f for f in first if f.kind == "rack"]
    assert racks and all(len(f.groups) == 4 and f.groups[0] % 4 == 0 for f in racks)
    # Independent of the fleet's size: a group's failures do not move when others join.
    bigger = failure_schedule(model, seed=7, n_groups=80, horizon_s=600.0)
    assert [f for f in first if f.kind == "group"] == [
        f for f in bigger if f.kind == "group" and f.groups[0] < 40
    ]


def test_the_failure_rate_matches_the_mean_time_between_failures() -> None:
    for dist in ("exp", "weibull"):
        model = FailureModel(group_mtbf_s=100.0, dist=dist, rack_mtbf_s=None)
        failures = failure_schedule(model, seed=0, n_groups=200, horizon_s=1000.0)
        assert 0.85 < len(failures) / (200 * 1000 / 100) < 1.15, dist
    assert failure_schedule(FAULT_FREE, seed=0, n_groups=200, horizon_s=1000.0) == []


def test_the_virtual_clock_advances_only_by_events() -> None:
    fleet = exact_fleet()
    result = fleet.run(record_times=True)
    assert fleet.times == sorted(fleet.times)
    assert fleet.now == fleet.times[-1] <= EXACT.seconds
    assert result.events == len(fleet.times)
    # Nothing reads the wall clock: the same run again is the same, event for event.
    again = exact_fleet().run()
    assert result.issued_at == again.issued_at


def test_a_fault_free_fleet_issues_a_quorum_every_step_and_its_goodput_is_one() -> None:
    result = exact_fleet().run()
    # An event at the horizon still happens: the step issued at 16 ends after it.
    assert result.issued_at == [float(t) for t in range(17)]
    assert result.trained == 3 * result.fleet_steps == 3 * 16
    assert goodput(result, result) == 1.0
    assert result.failures == result.failed_steps == 0


def test_the_fault_free_goodput_is_one_with_measured_pacing_too() -> None:
    config = FleetConfig(n_groups=50, seconds=6.0, warmup_s=1.0, seed=3)
    result = Fleet(config).run()
    assert result.fleet_steps > 0
    assert result.trained == 50 * result.fleet_steps
    assert goodput(result, result) == 1.0


def test_a_failure_fails_the_step_and_the_next_quorum_is_issued_without_the_group() -> None:
    fleet = exact_fleet(kill=2.5)
    result = fleet.run()
    # Step [2, 3) fails at 2.5: the survivors hear of it and ask again 0.5 s
    # later, and the lighthouse, which saw group 1's stream end, issues a
    # quorum of the two at once (no wait for the dead group).
    assert result.issued_at[:5] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert result.failures == result.failed_steps == 1
    members = fleet.m.prev_quorum
    assert members is not None
    # Group 1 restarts at 12.5 at step 0 and waits for the others (13.0): it
    # heals in that step and trains from the next.
    assert result.issued_at == [float(t) for t in range(17)]
    assert [rid.split(":")[0] for rid in members.replica_ids()] == [
        "g000000",
        "g000001",
        "g000002",
    ]
    # Trained group-steps: 2 steps of 3, the failed step none, 2 per step from
    # 3.0 to 12.0 (10 steps), 2 at 13 (group 1 heals), 3 at 14 and 15.
    assert result.trained == 2 * 3 + 10 * 2 + 2 + 2 * 3


def test_a_spare_takes_the_dead_groups_place() -> None:
    fleet = exact_fleet(replace(EXACT, spares=1), kill=2.5)
    result = fleet.run()
    assert result.promotions == 1
    # The spare is handed g000001 at 2.5, starts 1 s later and joins at 3.5,
    # after the two survivors' quorum at 3.0; it is in the quorum at 4.0.
    assert result.issued_at[:6] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    prev = fleet.m.prev_quorum
    assert prev is not None and len(prev.replica_ids()) == 3
    spare = fleet.by_name["g000001"]
    assert spare.pid == "p4" and spare.rid == "g000001:p4"
    # 2 steps of 3, 1 of 2 (3.0), 1 with the spare healing (4.0), then 3 a
    # step (5.0 to 15.0).
    assert result.trained == 2 * 3 + 2 + 2 + 3 * 11
    without = exact_fleet(kill=2.5).run()
    assert goodput(result, exact_fleet().run()) > goodput(without, exact_fleet().run())


def test_the_membership_state_memory_grows_with_the_fleet() -> None:
    small, large = state_memory_bytes(100), state_memory_bytes(1000)
    assert 0 < small < large


def test_quantile_and_keeping_up() -> None:
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0
    rows = [{"groups": 1000, "cpu_core": 0.01}, {"groups": 10000, "cpu_core": 0.1}]
    assert "near 100,000 groups" in keeping_up(rows)
    rows.append({"groups": 100000, "cpu_core": 1.5})
    assert "from 100000 groups (measured)" in keeping_up(rows)
    assert "near 10,000 groups" in keeping_up(
        [{"groups": 100, "x": 0.01}, {"groups": 1000, "x": 0.1}], "x"
    )
