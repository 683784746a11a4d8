"""pytorch/torchft's public behaviour that code written against it relies on,
with a real lighthouse, real gRPC and real gloo."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore

from lighthouse import LighthouseClient, LighthouseServer
from lighthouse.rpc.errors import LighthouseUnavailableError
from tests.integration._replica import small_replica
from torchft_like import OptimizerWrapper

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def lighthouse():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    yield server
    server.shutdown()


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _manager(store: TCPStore, lighthouse_addr: str, group_world_size: int = 1, **kwargs):
    """Rank 0 of a group of `group_world_size`, whose other ranks never come."""
    model = nn.Linear(3, 4)
    inner = torch.optim.AdamW(model.parameters())
    manager = small_replica(0, 0, group_world_size, store, lighthouse_addr, model, inner, **kwargs)
    return manager, inner


def test_the_client_returns_each_members_data_decoded(lighthouse):
    client = LighthouseClient(lighthouse.address(), connect_timeout=timedelta(seconds=5))
    try:
        quorum = client.quorum("a", timedelta(seconds=5), data={"my_data": 1234})
        assert [m.data for m in quorum.participants] == [{"my_data": 1234}]
        quorum = client.quorum("a", timedelta(seconds=5))
        assert [m.data for m in quorum.participants] == [None]
    finally:
        client.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_client_waits_for_a_lighthouse_that_starts_late_within_its_connect_timeout():
    port = _free_port()
    servers: list[LighthouseServer] = []
    # The scenario itself: the lighthouse comes up a second after its client.
    late = threading.Timer(
        1.0, lambda: servers.append(LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1))
    )
    late.start()
    client = LighthouseClient(f"http://127.0.0.1:{port}", connect_timeout=timedelta(seconds=10))
    try:
        quorum = client.quorum("a", timedelta(seconds=10))
        assert quorum.replica_ids() == ("a",)
    finally:
        late.join()
        client.close()
        for server in servers:
            server.shutdown()


def test_a_client_with_nothing_listening_fails_after_its_connect_timeout():
    client = LighthouseClient(
        f"http://127.0.0.1:{_free_port()}", connect_timeout=timedelta(seconds=1)
    )
    start = time.monotonic()
    with pytest.raises(LighthouseUnavailableError, match="within 1.0 s"):
        client.heartbeat("a")
    assert 0.9 < time.monotonic() - start < 3
    client.close()


def test_manager_shutdown_after_the_lighthouse_stopped_is_prompt_and_quiet(store):
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    manager, _ = _manager(store, server.address(), use_async_quorum=False)
    manager.start_quorum()
    server.shutdown()
    start = time.monotonic()
    manager.shutdown()
    assert time.monotonic() - start < 1.0


def test_a_synchronous_quorum_or_vote_that_times_out_raises_timeout_error(store):
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    # Rank 1 of the group never asks nor votes: both calls wait for it.
    manager, _ = _manager(store, server.address(), group_world_size=2, use_async_quorum=False)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            manager.start_quorum(timeout=timedelta(seconds=0.2))
        with pytest.raises(TimeoutError):
            manager.should_commit(timeout=timedelta(seconds=0.2))
        assert time.monotonic() - start < 5
        assert manager.errored() is not None  # recorded too: the step cannot commit
    finally:
        manager.shutdown(wait=False)
        server.shutdown()


def test_the_optimizer_wrapper_is_a_full_facade_of_the_wrapped_optimizer(store, lighthouse):
    manager, inner = _manager(store, lighthouse.address())
    try:
        optimizer = OptimizerWrapper(manager, inner)
        optimizer.add_param_group({"params": [], "lr": 1e-4})
        assert optimizer.defaults is inner.defaults
        assert optimizer.param_groups is inner.param_groups
        assert inner.param_groups[1]["lr"] == 1e-4
        optimizer.load_state_dict(optimizer.state_dict())
        optimizer.zero_grad()
        assert optimizer.state is inner.state
    finally:
        manager.shutdown()
