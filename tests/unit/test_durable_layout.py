"""Durable checkpoint layout: which step is complete, what each rank prunes."""

from __future__ import annotations

import pytest

from torchft_like.checkpointing import durable_layout as layout


@pytest.mark.parametrize(
    ("steps", "world_size", "newest"),
    [
        ({}, 1, None),
        ({100: {0}}, 1, 100),
        ({100: {0}, 200: {0}}, 1, 200),
        # Rank 1 died mid-write of step 200: step 100 is the newest usable.
        ({100: {0, 1}, 200: {0}}, 2, 100),
        ({100: {1}, 200: set()}, 2, None),
        ({100: {0, 1, 2}}, 2, 100),
    ],
)
def test_the_newest_step_is_the_newest_every_rank_completed(steps, world_size, newest):
    assert layout.newest_complete(steps, world_size) == newest


@pytest.mark.parametrize(
    ("steps", "rank", "keep", "pruned"),
    [
        ({100: {0}, 200: {0}, 300: {0}}, 0, 2, [100]),
        ({100: {0}, 200: {0}, 300: {0}}, 0, 3, []),
        ({100: {0}, 200: {0}, 300: {0}}, 0, 1, [100, 200]),
        # An unfinished older step goes too; a newer unfinished one (in flight) stays.
        ({100: set(), 200: {0}, 300: {0}, 400: set()}, 0, 2, [100]),
        # Only this rank's complete parts count toward keep.
        ({100: {0, 1}, 200: {1}, 300: {0, 1}}, 0, 2, []),
        ({100: {0, 1}, 200: {1}, 300: {0, 1}}, 1, 2, [100]),
        ({100: {1}}, 0, 1, []),
    ],
)
def test_a_rank_prunes_its_parts_older_than_its_newest_kept(steps, rank, keep, pruned):
    assert layout.steps_to_prune(steps, rank, keep) == pruned


def test_only_rank_parts_with_the_marker_are_complete():
    listing = {"rank_0": ["COMPLETE", ".metadata"], "rank_1": [".metadata"], "junk": ["COMPLETE"]}
    assert layout.complete_ranks(listing) == {0}


@pytest.mark.parametrize(
    ("name", "step"),
    [("step_000000100", 100), ("step_100", None), (".tmp-step_000000100-r0-ab", None)],
)
def test_step_directories_are_recognised_by_name(name, step):
    assert layout.parse_step(name) == step
    if step is not None:
        assert layout.step_dir(step) == name


def test_bad_settings_are_refused_naming_the_value_and_the_rule():
    with pytest.raises(ValueError, match=r"keep \(0\) must be at least 1"):
        layout.steps_to_prune({}, 0, 0)
    with pytest.raises(ValueError, match=r"world_size \(0\) must be at least 1"):
        layout.newest_complete({}, 0)
