"""bench.step_overhead's statistics, on made-up series: no processes."""

import random

import pytest

from bench.step_overhead import (
    cpu_drift,
    drift_interval,
    drift_vs_plain,
    geo_mean,
    ratio_interval,
    round_rows,
    summarize,
)


@pytest.mark.parametrize(
    "ours, plain, own, machine",
    [
        # The machine slows by 20% through the run: both drift, ours alone does not.
        ([50, 50, 55, 60, 60], [40, 40, 44, 48, 48], 0.0, 0.2),
        # Ours grows 10% on a steady machine.
        ([50, 50, 52, 55, 55], [40, 40, 40, 40, 40], 0.1, 0.1),
        # The machine speeds up 10% (plain's CPU falls) and ours does not: a
        # drift of its own that cpu_drift hides.
        ([50, 50, 50, 50, 50.0], [40, 40, 38, 36.36, 36.36], 0.1, 0.0),
    ],
)
def test_drift_against_plain_is_the_contenders_own(ours, plain, own, machine):
    assert drift_vs_plain(ours, plain) == pytest.approx(own, abs=0.001)
    assert cpu_drift(ours) == pytest.approx(machine, abs=0.001)


def test_the_ratio_interval_holds_the_geometric_mean_and_narrows_with_rounds():
    few = [1.0, 1.04, 0.98, 1.02]
    many = few * 10
    low_few, high_few = ratio_interval(few)
    low_many, high_many = ratio_interval(many)
    assert low_few <= geo_mean(few) <= high_few
    assert high_many - low_many < high_few - low_few


def test_rounds_of_one_launch_count_as_one_draw_in_the_interval():
    # Two launches, each steady within itself, 10% apart: resampling rounds
    # alone would claim a tight interval; launches resampled show the spread.
    jitter = [0.001 * (i % 3) for i in range(30)]
    ratios = [0.95 + j for j in jitter] + [1.05 + j for j in jitter]
    launches = [0] * 30 + [1] * 30
    low, high = ratio_interval(ratios)
    low_l, high_l = ratio_interval(ratios, launches)
    assert high - low < 0.03
    assert low_l < 0.96 and high_l > 1.04
    assert low_l <= geo_mean(ratios) <= high_l


def test_each_launch_has_its_own_ratio_and_faults():
    def blocks(step_s: list[float], faults: int) -> list[dict]:
        return [
            {"launch": i // 2, "times": [s], "cpu": [s], "minflt": [faults * (1 + i // 2)],
             "rpcs_per_step": 1.0}
            for i, s in enumerate(step_s)
        ]  # fmt: skip

    row = summarize(1000, "default", {
        "plain": blocks([0.050, 0.050, 0.050, 0.050], 10),
        "ft": blocks([0.045, 0.045, 0.055, 0.055], 20),
    })  # fmt: skip
    assert row["ft_ratio_by_launch"] == row["ft_ratio_cpu_by_launch"] == "0.900 1.100"
    assert row["ft_minflt_by_launch"] == "20 40"
    assert row["plain_minflt_by_launch"] == "10 20"


def test_a_baseline_of_ours_is_compared_with_ours_round_by_round():
    def blocks(step_s: list[float]) -> list[dict]:
        return [
            {"times": [s, s], "cpu": [s / 2, s / 2], "minflt": [0], "rpcs_per_step": 1.0}
            for s in step_s
        ]

    # The machine slows down over the rounds; ft stays 2% faster than ftbase.
    row = summarize(1000, "default", {
        "plain": blocks([0.050, 0.060, 0.070]),
        "ft": blocks([0.049, 0.0588, 0.0686]),
        "ftbase": blocks([0.050, 0.060, 0.070]),
    })  # fmt: skip
    assert row["ft_vs_ftbase"] == row["ft_vs_ftbase_cpu"] == 0.98
    assert row["ft_vs_ftbase_ci95"] == "0.980-0.980"
    assert row["ftbase_ratio"] == 1.0


def test_each_rounds_block_medians_are_kept_in_run_order():
    def blocks(step_s: list[float]) -> list[dict]:
        return [{"times": [s, 2 * s, s], "cpu": [s / 2] * 3} for s in step_s]

    rows = round_rows(1000, "keep", {"plain": blocks([0.05, 0.06]), "ft": blocks([0.04, 0.07])})
    assert rows == [
        {"hidden": 1000, "allocator": "keep", "round": 0,
         "plain_ms": 50.0, "plain_cpu_ms": 25.0, "ft_ms": 40.0, "ft_cpu_ms": 20.0},
        {"hidden": 1000, "allocator": "keep", "round": 1,
         "plain_ms": 60.0, "plain_cpu_ms": 30.0, "ft_ms": 70.0, "ft_cpu_ms": 35.0},
    ]  # fmt: skip


def test_a_drift_is_given_with_the_noise_around_it():
    rng = random.Random(1)
    noise = [1.0 + rng.uniform(-0.1, 0.1) for _ in range(200)]  # +-10%, no trend
    low, high = drift_interval(noise)
    assert low < cpu_drift(noise) < high and low < 0 < high
    grows = [n * (1 + 0.2 * i / 199) for i, n in enumerate(noise)]  # +20% over the run
    low, high = drift_interval(grows)
    assert 0.1 < low < cpu_drift(grows) < high < 0.25
    few_low, few_high = drift_interval(grows[::10])
    assert few_high - few_low > high - low
