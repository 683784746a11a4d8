"""By default the Manager's per-step threads run under SCHED_BATCH (they
never preempt training); the training thread and the lighthouse keep the
default policy; TORCHFT_LIKE_CONTROL_SCHED=normal leaves every thread as it
started."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from lighthouse import LighthouseServer
from lighthouse import loop as loop_module
from lighthouse.loop import BackgroundLoop
from torchft_like import Manager, ProcessGroupGloo

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="Linux scheduling policies"),
]
T = timedelta(seconds=10)


def policy_of(prefix: str) -> int:
    [thread] = [t for t in threading.enumerate() if t.name.startswith(prefix)]
    assert thread.native_id is not None
    return os.sched_getscheduler(thread.native_id)


async def own_policy() -> int:
    return os.sched_getscheduler(0)


@pytest.mark.parametrize("setting, expected", [(None, os.SCHED_BATCH), ("normal", os.SCHED_OTHER)])
def test_a_managers_per_step_threads_yield_to_training(monkeypatch, setting, expected):
    if setting is None:
        monkeypatch.delenv("TORCHFT_LIKE_CONTROL_SCHED", raising=False)
    else:
        monkeypatch.setenv("TORCHFT_LIKE_CONTROL_SCHED", setting)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=0)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=T), load_state_dict=lambda _: None, state_dict=lambda: {},
        min_replica_size=1, rank=0, world_size=1, store_addr="127.0.0.1",
        store_port=store.port, lighthouse_addr=lighthouse.address(), replica_id="sched",
        hostname="127.0.0.1", connect_timeout=T, timeout=T, exit_with_parent=False,
    )  # fmt: skip
    try:
        manager.start_quorum()
        manager.allreduce(torch.ones(4)).wait()
        assert manager.should_commit()
        # The quorum thread starts with the first quorum that is not steady
        # (the first one configures the process group).
        assert policy_of("torchft_manager_server_sched") == expected
        assert policy_of("torchft_quorum") == expected
        assert policy_of("torchft_freeze_watch") == expected
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the training thread
        assert lighthouse._loop.run(own_policy()) == os.SCHED_OTHER
    finally:
        manager.shutdown()
        lighthouse.shutdown()


def test_a_reused_loop_takes_its_new_owners_policy(monkeypatch):
    parked: list = []
    monkeypatch.setattr(loop_module, "_parked", parked)  # room to park, whatever ran before
    loop = BackgroundLoop("first", batch=True)
    assert loop.run(own_policy()) == os.SCHED_BATCH
    loop.stop()  # parked for the next owner
    again = BackgroundLoop("second")
    try:
        assert again.loop is loop.loop
        assert again.run(own_policy()) == os.SCHED_OTHER
    finally:
        again.stop()
        for event_loop, thread in parked:  # ends what this test's list kept
            event_loop.call_soon_threadsafe(event_loop.stop)
            thread.join(5)
            event_loop.close()
