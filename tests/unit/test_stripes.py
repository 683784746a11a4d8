"""The bookkeeping of striped healing: which source fetches which byte range."""

from __future__ import annotations

import threading

import pytest
import torch

from torchft_like.checkpointing import state_format
from torchft_like.checkpointing.striped import Stripes, layout_difference


def drain(stripes: Stripes, order: list[int]) -> list[tuple[int, int]]:
    """Takes and finishes ranges for the sources in `order`, cycling, until none is left."""
    got = []
    while not stripes.complete():
        progressed = False
        for s in order:
            r = stripes.take(s)
            if r is not None:
                stripes.finish(r, s)
                got.append((s, r))
                progressed = True
        assert progressed, "ranges left that no source takes"
    return got


def test_each_source_fetches_its_own_ranges_in_order_when_all_are_healthy():
    stripes = Stripes(6, 3)
    assert drain(stripes, [0, 1, 2]) == [(0, 0), (1, 1), (2, 2), (0, 3), (1, 4), (2, 5)]
    assert stripes.delivered_by() == {0: [0, 3], 1: [1, 4], 2: [2, 5]}


def test_a_failed_source_gives_its_range_back_and_the_others_take_its_ranges():
    stripes = Stripes(6, 3)
    taken = [stripes.take(s) for s in range(3)]
    assert taken == [0, 1, 2]
    stripes.fail(1, 1, ConnectionResetError("reset"))
    assert stripes.take(1) is None  # dead for the rest of the fetch
    stripes.finish(0, 0)
    stripes.finish(2, 2)
    # Source 0 takes its own range 3 first, then the orphaned ones (1 before 4).
    assert stripes.take(0) == 3
    assert stripes.take(2) == 5
    assert stripes.take(2) == 1
    assert stripes.take(0) == 4
    for r, s in [(3, 0), (5, 2), (1, 2), (4, 0)]:
        stripes.finish(r, s)
    assert stripes.complete() and stripes.refetched == 1
    assert stripes.delivered_by() == {0: [0, 3, 4], 1: [], 2: [1, 2, 5]}


def test_a_source_done_early_takes_over_the_end_of_a_slower_ones_work():
    stripes = Stripes(6, 2)  # source 0: 0 2 4, source 1: 1 3 5
    assert [stripes.take(0) for _ in range(3)] == [0, 2, 4]
    assert stripes.take(1) == 1
    for r in (0, 2, 4):
        stripes.finish(r, 0)
    assert stripes.take(0) == 5  # from the end of source 1's, which keeps reading in order
    assert stripes.take(1) == 3


def test_a_source_not_serving_yet_gives_its_range_back_and_stays_alive():
    stripes = Stripes(4, 2)
    assert stripes.take(1) == 1
    stripes.give_back(1, 1)
    assert not stripes.errors and stripes.refetched == 0
    assert stripes.take(0) == 0
    assert stripes.take(1) == 1  # its own range again, on its next try


def test_when_every_source_failed_nothing_is_taken_and_the_fetch_has_failed():
    stripes = Stripes(4, 2)
    r0, r1 = stripes.take(0), stripes.take(1)
    stripes.fail(r0, 0, ConnectionRefusedError("refused"))
    assert not stripes.failed()
    stripes.fail(r1, 1, TimeoutError("stalled"))
    assert stripes.failed() and not stripes.complete()
    assert stripes.take(0) is None and stripes.take(1) is None
    assert set(stripes.errors) == {0, 1}


def test_a_waiting_source_wakes_up_to_take_a_range_another_gave_back():
    stripes = Stripes(2, 2)
    assert (stripes.take(0), stripes.take(1)) == (0, 1)
    stripes.finish(0, 0)
    got: list[int | None] = []
    waiter = threading.Thread(target=lambda: got.append(stripes.take(0, timeout=10)))
    waiter.start()
    stripes.fail(1, 1, ConnectionResetError("reset"))
    waiter.join(5)
    assert got == [1]


def test_a_waiting_source_gives_up_once_nothing_is_in_flight():
    stripes = Stripes(2, 2)
    assert (stripes.take(0), stripes.take(1)) == (0, 1)
    stripes.finish(0, 0)
    got: list[int | None] = []
    waiter = threading.Thread(target=lambda: got.append(stripes.take(0, timeout=10)))
    waiter.start()
    stripes.finish(1, 1)
    waiter.join(5)
    assert got == [None] and stripes.complete()


def test_bookkeeping_refuses_a_range_the_source_does_not_hold():
    stripes = Stripes(2, 2)
    stripes.take(0)
    with pytest.raises(RuntimeError, match="range 1 is not being fetched by source 0"):
        stripes.finish(1, 0)


@pytest.mark.parametrize("ranges, sources", [(2, 3), (3, 0)])
def test_too_few_ranges_or_no_source_is_an_error(ranges, sources):
    with pytest.raises(ValueError, match="at least one source and a range per source"):
        Stripes(ranges, sources)


def header(state, step: int = 3) -> bytes:
    tree, _ = state_format.flatten(state)
    raw = state_format.encode_header(step, tree, "crc32c")
    return raw[state_format.PREFIX.size :]


def test_the_layout_header_is_deterministic_for_equal_states():
    a = {"w": torch.ones(3), "opt": {"lr": 0.1, "n": [1, 2]}}
    b = {"w": torch.zeros(3), "opt": {"lr": 0.1, "n": [1, 2]}}  # other bytes, same layout
    assert header(a) == header(b)
    assert layout_difference(header(a), header(b)) is None


@pytest.mark.parametrize(
    "other, why",
    [
        ({"w": torch.ones(4), "opt": {"lr": 0.1}}, "tensor state['w']"),
        ({"w": torch.ones(3).half(), "opt": {"lr": 0.1}}, "torch.float16"),
        ({"w": torch.ones(3), "opt": {"lr": 0.2}}, "non-tensor values"),
        ({"w": torch.ones(3), "v": torch.ones(1), "opt": {"lr": 0.1}}, "1 vs 2 tensors"),
    ],
)
def test_layouts_that_differ_are_named(other, why):
    mine = {"w": torch.ones(3), "opt": {"lr": 0.1}}
    assert why in layout_difference(header(mine), header(other))


def test_another_step_or_checksum_is_a_difference_but_another_cuda_index_is_not():
    mine = {"w": torch.ones(3)}
    assert layout_difference(header(mine, 3), header(mine, 4)) == "step 3 vs 4"
    tree, _ = state_format.flatten(mine)
    zlib = state_format.encode_header(3, tree, "crc32")[state_format.PREFIX.size :]
    assert "checksum crc32c vs crc32" in layout_difference(header(mine), zlib)
    cuda0 = header(mine).replace(b'"cpu"', b'"cuda:0"')
    cuda1 = header(mine).replace(b'"cpu"', b'"cuda:1"')
    assert layout_difference(cuda0, cuda1) is None
