"""The NCCL groups on a real GPU, as scripts/gpu_check.sh runs them: many
reconfigurations leave nothing behind (GPU memory, file descriptors), and a
collective whose peer never joins it is aborted within its timeout + 1 s.

Each test records its figures (tests/gpu/conftest.py, `figure`). The peer
of the timeout test is this module run as a script (`peer`), a real process
that configures its rank and then sleeps; the `children` fixture kills it."""

from __future__ import annotations

import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import ReduceOp

from tests.gpu.conftest import device_used, growth, need_gpus, open_fds
from tests.procs import PYTHON, wait_for_line
from torchft_like.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo, ProcessGroupNCCL

pytestmark = pytest.mark.cuda

CYCLES = int(os.environ.get("GPU_CHECK_CYCLES", "200"))
"""configure-abort cycles (the issue's 200)."""
CAP_S = {"nccl": 60.0, "baby_nccl": 75.0}
"""Each loop stops here even short of CYCLES: the Baby form starts a child
(torch imported) per configure, whose pace this machine sets. The cycles
done are a figure; fewer than MIN_CYCLES fail the check."""
MIN_CYCLES = {"nccl": 100, "baby_nccl": 30}
SKIP = 10
"""First samples left out: the first communicators allocate lazily."""
WINDOW = 20
ALLOCATED_SLACK = 1 << 20
"""Our allocator's bytes: the tensors are reused, so any growth is a leak."""
DEVICE_SLACK = 64 << 20
"""The whole GPU's: a communicator leaked per cycle holds far more than this
between the first and the last window."""
FD_SLACK = 2
TIMEOUT_S = 2.0
"""The collective timeout of the timeout test."""


def make_group(kind: str, timeout: timedelta) -> Any:
    return ProcessGroupNCCL(timeout) if kind == "nccl" else ProcessGroupBabyNCCL(timeout)


def mib(n: float) -> float:
    return round(n / (1 << 20), 1)


@pytest.mark.timeout(95)
@pytest.mark.parametrize("kind", ["nccl", "baby_nccl"])
def test_reconfigure_leaves_memory_and_fds_flat(kind, tcp_store, figure) -> None:
    torch.cuda.set_device(0)
    pg = make_group(kind, timedelta(seconds=30))
    t = torch.empty(1 << 20, device="cuda:0")
    allocated: list[float] = []
    used: list[float] = []
    fds: list[float] = []
    cycle_s: list[float] = []
    start = time.monotonic()
    try:
        for cycle in range(CYCLES):
            if time.monotonic() - start > CAP_S[kind]:
                break
            t0 = time.monotonic()
            pg.configure(f"127.0.0.1:{tcp_store.port}/flat/{cycle}", "r0", 0, 1)
            t.fill_(float(cycle))
            pg.allreduce([t], ReduceOp.SUM).wait()
            torch.cuda.synchronize()
            assert t[0].item() == cycle, "world size 1: the sum is the tensor itself"
            assert pg.errored() is None
            allocated.append(torch.cuda.memory_allocated(0))
            used.append(device_used(0))
            fds.append(open_fds())
            pg.abort()
            cycle_s.append(time.monotonic() - t0)
    finally:
        pg.shutdown()
    cycles = len(cycle_s)
    figure("cycles", cycles)
    figure("cycle_ms_median", round(1000 * statistics.median(cycle_s), 1))
    assert cycles >= MIN_CYCLES[kind], f"only {cycles} cycles within {CAP_S[kind]} s"
    window = min(WINDOW, (cycles - SKIP) // 2)
    grew = {
        "allocated_mib": mib(growth(allocated[SKIP:], window)),
        "device_used_mib": mib(growth(used[SKIP:], window)),
        "fds": growth(fds[SKIP:], window),
    }
    figure("growth", grew)
    figure("device_used_mib_first_last", [mib(used[SKIP]), mib(used[-1])])
    figure("fds_first_last", [fds[SKIP], fds[-1]])
    assert grew["allocated_mib"] <= mib(ALLOCATED_SLACK), grew
    assert grew["device_used_mib"] <= mib(DEVICE_SLACK), grew
    assert grew["fds"] <= FD_SLACK, grew


@pytest.mark.timeout(45)
@pytest.mark.parametrize("kind", ["gloo_cuda", "nccl"])
def test_collective_past_timeout_aborts(kind, tcp_store, children, figure) -> None:
    """Rank 1, a real process, configures and then sleeps; rank 0's
    allreduce on the GPU must fail within TIMEOUT_S + 1 s, errored() saying
    so. NCCL needs a GPU per rank; gloo takes both ranks on one GPU."""
    if kind == "nccl":
        need_gpus(2)
    addr = f"127.0.0.1:{tcp_store.port}/timeout"
    peer_device = "1" if kind == "nccl" else "0"
    peer = children.spawn([PYTHON, "-m", "tests.gpu.test_gpu_nccl", "peer", kind, addr,
                           peer_device])  # fmt: skip
    wait_for_line(peer, r"^configuring", timeout=60)
    torch.cuda.set_device(0)
    pg: Any
    if kind == "nccl":  # the join may wait for the peer; the collective gets TIMEOUT_S
        pg = ProcessGroupNCCL(timedelta(seconds=30))
        pg.configure(addr, "r0", 0, 2)
        pg.set_timeout(timedelta(seconds=TIMEOUT_S))
    else:  # gloo fixes its timeout at configure; the peer already waits there
        pg = ProcessGroupGloo(timedelta(seconds=TIMEOUT_S))
        pg.configure(addr, "r0", 0, 2)
    try:
        t = torch.ones(1 << 20, device="cuda:0")
        start = time.monotonic()
        work = pg.allreduce([t], ReduceOp.SUM)
        raised: Exception | None = None
        try:
            work.wait()  # gloo: until its timeout; NCCL: at once (the stream waits)
        except Exception as e:
            raised = e
        deadline = start + TIMEOUT_S + 10
        while (error := pg.errored()) is None and time.monotonic() < deadline:
            time.sleep(0.01)  # NCCL's errored() itself waits for the watchdog
        abort_s = time.monotonic() - start
    finally:
        pg.shutdown()
    figure("variant", kind)
    figure("timeout_s", TIMEOUT_S)
    figure("abort_s", round(abort_s, 3))
    figure("error", str(error or raised)[:300])
    assert error is not None, f"errored() is None {abort_s:.1f} s after the collective"
    assert abort_s <= TIMEOUT_S + 1.0, f"aborted after {abort_s:.2f} s (timeout {TIMEOUT_S} s)"


def peer(kind: str, addr: str, device: int) -> None:
    """Rank 1 of the timeout test: joins, then never joins a collective."""
    torch.cuda.set_device(device)
    timeout = timedelta(seconds=60)
    pg = ProcessGroupNCCL(timeout) if kind == "nccl" else ProcessGroupGloo(timeout)
    print("configuring", flush=True)
    pg.configure(addr, "r1", 1, 2)
    print("configured; sleeping until killed", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "peer":
        sys.exit("usage: python -m tests.gpu.test_gpu_nccl peer KIND STORE_ADDR DEVICE")
    peer(sys.argv[2], sys.argv[3], int(sys.argv[4]))
