"""ProcessGroupBabyGloo: gloo in a child process. Two members as threads of
this process (each with its own child), a real TCPStore: collectives work,
abort kills the child and fails the collective in flight at once, and a
later configure builds a working group again."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from torchft_like.process_group import ProcessGroupBabyGloo

pytestmark = pytest.mark.timeout(180)


def test_collectives_then_abort_kills_the_child_and_a_later_configure_works():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # One member keeps a warm standby child, the other starts one per configure.
    pgs = [ProcessGroupBabyGloo(timeout=timedelta(seconds=60), standby=s) for s in (True, False)]
    pool = ThreadPoolExecutor(2)

    def configure(prefix: str) -> None:
        addr = f"127.0.0.1:{store.port}/{prefix}"
        list(pool.map(lambda r: pgs[r].configure(addr, f"r{r}", r, 2), range(2)))

    try:
        configure("first")
        ts = [torch.full((3,), float(r + 1)) for r in range(2)]
        for w in [pgs[r].allreduce([ts[r]], ReduceOp.SUM) for r in range(2)]:
            w.wait()
        assert all(torch.equal(t, torch.full((3,), 3.0)) for t in ts)
        outs = [[torch.empty(2) for _ in range(2)] for _ in range(2)]
        works = [pgs[r].allgather([outs[r]], [torch.full((2,), float(r))]) for r in range(2)]
        for w in works:
            w.wait()
        assert all(torch.equal(outs[r][1], torch.ones(2)) for r in range(2))
        with pytest.raises(RuntimeError, match="does not support reduce_scatter"):
            pgs[0].reduce_scatter([torch.empty(1)], [[torch.empty(1)]])

        # Only member 0 enters: its allreduce waits for member 1 until aborted.
        child = pgs[0]._child
        assert child is not None and child.is_alive()
        stuck = torch.zeros(4)
        work = pgs[0].allreduce([stuck], ReduceOp.SUM)
        time.sleep(0.2)  # time to get into the collective: no sign tells it is there
        start = time.monotonic()
        pgs[0].abort()
        with pytest.raises(RuntimeError, match="aborted"):
            work.wait()
        assert time.monotonic() - start < 1.0
        child.proc.wait(timeout=10)
        assert not child.is_alive() and pgs[0].errored() is not None
        assert torch.equal(stuck, torch.zeros(4)), "a killed collective leaves the tensor alone"
        pgs[1].abort()

        configure("second")
        assert pgs[0].errored() is None
        ts = [torch.full((2,), float(r + 1)) for r in range(2)]
        for w in [pgs[r].allreduce([ts[r]], ReduceOp.AVG) for r in range(2)]:
            w.wait()
        assert all(torch.equal(t, torch.full((2,), 1.5)) for t in ts)
    finally:
        for pg in pgs:
            pg.shutdown()
        pool.shutdown()
    with pytest.raises(OSError, match="handle is closed"):
        pgs[0].allreduce([torch.zeros(1)], ReduceOp.SUM)
