"""Manager API of torchft: state registered after construction, the state
read gate, and allreduce's should_quantize; real lighthouse, real gloo."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore

from lighthouse import LighthouseServer
from torchft_like import Manager, Optimizer, ProcessGroupGloo
from torchft_like.manager.state_gate import StateReadGate

pytestmark = pytest.mark.timeout(90)
T = timedelta(seconds=10)


def group_main(group: int, lighthouse: str) -> dict:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(group)  # different weights: init_sync must make them equal
    model = nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=T), min_replica_size=2, rank=0, world_size=1,
        store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse,
        replica_id=f"group{group}", hostname="127.0.0.1", timeout=T, connect_timeout=T,
    )  # fmt: skip
    try:
        # Registered once "the checkpointer exists", after construction.
        manager.set_state_dict_fns(
            lambda sd: (model.load_state_dict(sd["m"]), inner.load_state_dict(sd["o"])),
            lambda: {"m": model.state_dict(), "o": inner.state_dict()},
        )
        optimizer = Optimizer(manager, inner)
        ones = []
        while manager.current_step() < 3:
            optimizer.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            for p in model.parameters():
                manager.allreduce(p.grad, should_quantize=True)
            t = torch.full((5,), float(group + 1))
            manager.allreduce(t, True).wait()  # torchft's positional order
            ones.append(t)
            optimizer.step()
        return {"params": [p.detach().clone() for p in model.parameters()], "avg": ones}
    finally:
        manager.shutdown()


def test_state_set_after_construction_heals_and_should_quantize_is_close_and_identical():
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            a, b = pool.map(group_main, range(2), [lighthouse.address()] * 2)
    finally:
        lighthouse.shutdown()
    for pa, pb in zip(a["params"], b["params"]):
        assert torch.equal(pa, pb)  # group 1 healed from group 0 through the late fns
    for t, u in zip(a["avg"], b["avg"]):
        assert torch.equal(t, u)  # int8 on the wire, the same bytes on both groups
        # (1 + 2) / 2, within two int8 roundings (half a scale of 2/127, then of 3/127)
        torch.testing.assert_close(t, torch.full((5,), 1.5), rtol=0, atol=2.5 / 127)


def test_set_state_dict_fns_twice_is_a_clear_error():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=T), min_replica_size=1, rank=0, world_size=1,
        store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse.address(),
        replica_id="g", hostname="127.0.0.1", timeout=T, connect_timeout=T,
        load_state_dict=lambda sd: None, state_dict=lambda: {},
    )  # fmt: skip
    try:
        with pytest.raises(ValueError, match="'default' is already registered"):
            manager.set_state_dict_fns(lambda sd: None, lambda: {})
        with pytest.raises(ValueError, match=r"AVG of a torch.int64 tensor .*ReduceOp.SUM"):
            manager.allreduce(torch.ones(2, dtype=torch.int64))
        healed = {"user": {"set_state_dict_fns": {}}, "torchft": {"step": 3}}
        with pytest.raises(ValueError, match=r"no \['default'\].*torchft's set_state_dict_fns"):
            manager.load_full_state_dict(healed)  # what healing applies, e.g. from torchft
        manager.disallow_state_dict_read()
        manager.disallow_state_dict_read()  # idempotent
        assert not manager._is_state_dict_read_allowed
        manager.allow_state_dict_read()
        assert manager._is_state_dict_read_allowed
    finally:
        manager.shutdown()
        lighthouse.shutdown()


def test_a_read_waits_while_disallowed_and_disallow_waits_for_a_running_read():
    gate = StateReadGate(timeout_s=10)
    gate.disallow()
    entered, release = threading.Event(), threading.Event()

    def reader() -> None:
        with gate.read():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=reader)
    thread.start()
    assert not entered.wait(0.3), "a read ran while reads were disallowed"
    gate.allow()
    assert entered.wait(5)
    disallowed = threading.Event()
    writer = threading.Thread(target=lambda: (gate.disallow(), disallowed.set()))
    writer.start()
    assert not disallowed.wait(0.3), "disallow returned while a read was running"
    release.set()
    assert disallowed.wait(5)
    thread.join(5)
    writer.join(5)


def test_a_gate_left_disallowed_fails_the_read_naming_the_fix():
    gate = StateReadGate(timeout_s=0.1)
    gate.disallow()
    with pytest.raises(TimeoutError, match="call allow_state_dict_read"):
        with gate.read():
            pass
