"""The streaming heartbeat against real servers: a SIGKILLed group is dropped
at once, a live one never is, and the fallback to unary heartbeats works
against pytorch/torchft's Rust lighthouse."""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from lighthouse import LighthouseClient, LighthouseServer, QuorumError, QuorumTimeoutError
from lighthouse.client import AsyncLighthouseClient
from lighthouse.core.quorum import QuorumMember
from tests.procs import PYTHON, Children, wait_for_line
from tests.waiting import wait_until, wait_until_async
from tools.procs import free_port, kill_tree
from torchft_like.manager.group.client import LocalManagerClient
from torchft_like.manager.group.group_request import QuorumRequest
from torchft_like.manager.group.server import ManagerServer

pytestmark = pytest.mark.timeout(90)

# A replica group's rank 0 in a process of its own: its ManagerServer
# heartbeats on a stream; it joins one quorum, then idles until killed.
DOOMED = """
import os, sys, time
from datetime import timedelta
from lighthouse import LighthouseClient
from torchft_like.manager.group.server import ManagerServer
addr = sys.argv[1]
server = ManagerServer(replica_id="doomed", lighthouse_addr=addr, hostname="127.0.0.1",
                       bind="127.0.0.1:0", store_addr="doomed-store:1", world_size=1)
print("ready", flush=True)
while not os.path.exists(sys.argv[2]):  # the survivor is waiting: join it
    time.sleep(0.01)
q = LighthouseClient(addr).quorum("doomed", timedelta(seconds=30))
print("joined", q.quorum_id, flush=True)
time.sleep(600)  # until the test SIGKILLs it
"""


@pytest.fixture
def children():
    kids = Children()
    yield kids
    kids.kill_all()


def quorum_in_thread(client: LighthouseClient, rid: str, timeout: timedelta) -> dict:
    out: dict = {}

    def run() -> None:
        try:
            out["quorum"] = client.quorum(rid, timeout)
        except Exception as e:
            out["error"] = e

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def test_a_sigkilled_group_leaves_the_next_quorum_at_once(children, tmp_path):
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=5000)
    survivor = LighthouseClient(server.address())
    try:
        go = tmp_path / "go"
        doomed = children.spawn([PYTHON, "-c", DOOMED, server.address(), str(go)])
        wait_for_line(doomed, r"^ready", timeout=30)
        first = quorum_in_thread(survivor, "survivor", timedelta(seconds=30))
        # Doomed asks only once the survivor waits (its stream keeps the
        # survivor waiting for it): had it asked first, it would have been a
        # quorum of its own (min_replicas=1), and the survivor would wait out
        # the join timeout for a doomed that no longer asks.
        wait_until(
            lambda: any(
                r["waiting"] and r["replica_id"] == "survivor" for r in server.status()["replicas"]
            ),
            10,
            "the survivor's Quorum call at the lighthouse",
        )
        go.touch()
        wait_for_line(doomed, r"^joined", timeout=30)
        first["thread"].join(10)
        assert first["quorum"].replica_ids() == ("doomed", "survivor")

        # Alive, merely not asking: its open stream keeps it in the count.
        with pytest.raises(QuorumTimeoutError):
            survivor.quorum("survivor", timedelta(seconds=1))

        killed_at = time.monotonic()
        assert not kill_tree(doomed.pid)
        doomed.wait(10)
        quorum = survivor.quorum("survivor", timedelta(seconds=10))
        took = time.monotonic() - killed_at
        assert quorum.replica_ids() == ("survivor",)
        assert quorum.quorum_id > first["quorum"].quorum_id
        assert took < 1.0, f"the survivor waited {took:.2f} s for a quorum without the dead group"
        assert "[1 gone: heartbeat stream closed: doomed]" in server.status()["reason"]
    finally:
        survivor.close()
        server.shutdown()


def test_a_heartbeat_after_the_stream_closed_makes_the_replica_healthy_again():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)

    def healthy() -> bool:
        (replica,) = server.status()["replicas"]
        return replica["healthy"]

    async def scenario() -> list[bool]:
        client = AsyncLighthouseClient(server.address())
        seen = []
        try:
            assert await client.stream_heartbeat("r", timedelta(seconds=5))
            await wait_until_async(lambda: server.status()["replicas"], 10, "the first heartbeat")
            seen.append(healthy())
            client.close_heartbeat_stream()  # as a lighthouse restart or a blip would
            await wait_until_async(lambda: not healthy(), 10, "the closed stream to be noticed")
            seen.append(healthy())
            assert await client.stream_heartbeat("r", timedelta(seconds=5))
            await wait_until_async(healthy, 10, "the reconnected stream's heartbeat")
            seen.append(healthy())
        finally:
            await client.close()
        return seen

    try:
        assert asyncio.run(scenario()) == [True, False, True]
    finally:
        server.shutdown()


@pytest.fixture
def reference_lighthouse(tmp_path):
    """pytorch/torchft's Rust lighthouse, which knows no HeartbeatStream; its
    log (where it counts the replicas heartbeating) goes to a file."""
    exe = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("torchft-nightly's torchft_lighthouse is not installed")
    port = free_port()
    log = tmp_path / "reference.log"
    proc = subprocess.Popen(
        [exe, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}",
         "--heartbeat_timeout_ms", "500", "--join_timeout_ms", "60000"],
        stdout=subprocess.DEVNULL, stderr=open(log, "wb"), start_new_session=True,
    )  # fmt: skip

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            assert proc.poll() is None, log.read_text(errors="replace")
            return False

    try:
        wait_until(listening, 30, "the reference lighthouse to listen")
        yield f"http://127.0.0.1:{port}", log
    finally:
        assert not kill_tree(proc.pid)
        proc.wait(10)


def heartbeating_at_last_quorum(log: Path) -> int:
    """The Rust lighthouse logs `[N heartbeating]` with each decision; the one
    right after the last quorum request counts the requester as heartbeating
    (later ones, on its ticks, may not: the request is its only heartbeat)."""
    text = log.read_text(errors="replace")
    after_request = text.rsplit("Received quorum request", 1)
    assert len(after_request) == 2, f"no quorum request in the reference's log:\n{text}"
    count = re.search(r"\[(\d+) heartbeating\]", after_request[1])
    assert count, f"no decision after the last quorum request:\n{text}"
    return int(count.group(1))


def ask_for_a_quorum(client: LighthouseClient) -> None:
    """Makes the reference decide (and log) once; the answer does not matter."""
    try:
        client.quorum("observer", timedelta(seconds=1))
    except QuorumError:
        pass


def test_manager_server_falls_back_to_unary_heartbeats_on_the_reference_lighthouse(
    reference_lighthouse, caplog
):
    address, log = reference_lighthouse
    caplog.set_level(logging.INFO, logger="torchft_like.manager.group.session")
    observer = LighthouseClient(address)
    manager = ManagerServer(
        replica_id="fallback",
        lighthouse_addr=address,
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="fallback-store:1",
        world_size=1,
    )
    try:
        wait_until(
            lambda: "has no HeartbeatStream" in caplog.text,
            10,
            lambda: f"the fallback in the log:\n{caplog.text}",
        )
        # Unary heartbeats keep `fallback` heartbeating in the reference's
        # eyes well past its 500 ms heartbeat timeout (so the observer alone
        # is no majority and waits)...
        time.sleep(1.0)
        ask_for_a_quorum(observer)
        assert heartbeating_at_last_quorum(log) == 2
        # ... and stop with the ManagerServer.
        manager.shutdown()

        def counted_alone() -> bool:
            ask_for_a_quorum(observer)
            return heartbeating_at_last_quorum(log) == 1

        wait_until(counted_alone, 10, "the reference to stop counting the stopped server")
    finally:
        manager.shutdown()
        observer.close()


def test_manager_server_heartbeats_reach_a_restarted_lighthouse_on_the_same_port():
    port = free_port()
    lighthouse = LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1)
    manager = ManagerServer(
        replica_id="m",
        lighthouse_addr=lighthouse.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="m-store:1",
        world_size=1,
    )

    def healthy_on(server: LighthouseServer) -> bool:
        return any(r["healthy"] for r in server.status()["replicas"])

    try:
        asyncio.run(wait_until_async(lambda: healthy_on(lighthouse), 10, "a heartbeat"))
        lighthouse.shutdown()
        lighthouse = LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1)
        asyncio.run(
            wait_until_async(lambda: healthy_on(lighthouse), 20, "a heartbeat after the restart")
        )
    finally:
        manager.shutdown()
        lighthouse.shutdown()


def test_a_group_stepping_faster_than_its_heartbeats_sends_fewer_but_keeps_its_stream():
    """Quorum calls count as heartbeats, so a group stepping every ~20 ms
    sends few; but a stream that ended (here closed from our side, as a
    lighthouse or proxy may end it) is opened again at once, though every
    Quorum call still succeeds: death detection and gone notices ride on it."""
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    manager = ManagerServer(
        replica_id="fast",
        lighthouse_addr=lighthouse.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="fast-store:1",
        world_size=1,
    )
    sent = []
    stream_heartbeat = manager.session.client.stream_heartbeat

    async def counted(*args):
        sent.append(time.monotonic())
        return await stream_heartbeat(*args)

    async def end_stream() -> None:
        manager.session.client.close_heartbeat_stream()

    manager.session.client.stream_heartbeat = counted
    stop = threading.Event()

    def step() -> None:
        client, step = LocalManagerClient(manager), 0
        while not stop.is_set():
            client.quorum(QuorumRequest(group_rank=0, step=step), timedelta(seconds=30))
            step += 1
            time.sleep(0.02)  # a step every ~20 ms, faster than the heartbeats

    def streams() -> list[object]:
        """The group's open streams' outboxes, as the lighthouse holds them
        (held here, so that a new one cannot reuse an old one's identity)."""
        return [
            b
            for rid, bs in lighthouse.jobs.default.outboxes.items()
            if rid.startswith("fast")
            for b in bs
        ]

    stepper = threading.Thread(target=step, daemon=True)
    try:
        time.sleep(0.8)  # the window the idle heartbeat count is taken over
        idle = len(sent)
        stepper.start()
        time.sleep(0.4)  # time for the stepping to settle in
        begun = len(sent)
        time.sleep(0.8)  # the same window, stepping
        assert len(sent) - begun <= idle // 2, (idle, len(sent) - begun)
        first = streams()
        assert first and stepper.is_alive()
        manager.run(end_stream(), 5)

        # The reopen may land between two polls, so wait for the stream to be
        # replaced rather than for a moment with none.
        def replaced() -> bool:
            now = streams()
            return bool(now) and not any(b is old for b in now for old in first)

        asyncio.run(wait_until_async(replaced, 5, "a new stream while stepping"))
        assert stepper.is_alive()
    finally:
        stop.set()
        stepper.join(timeout=30)
        manager.shutdown()
        lighthouse.shutdown()


def test_the_quorum_call_goes_lean_to_torchfts_rust_lighthouse(reference_lighthouse):
    """lighthouse.rpc.lean.client speaks tonic's HTTP/2 (its SETTINGS, HPACK
    table, trailers) as well as ours."""
    address, _ = reference_lighthouse

    async def run() -> None:
        client = AsyncLighthouseClient(address)

        def no_grpcio(*args, **kwargs):
            raise AssertionError("the Quorum call went through grpcio")

        client._calls.grpcio.unary_unary = no_grpcio
        member = QuorumMember(replica_id="a", address="a:1", store_address="s:1", step=3)
        for _ in range(3):
            quorum = await client.quorum(member, timedelta(seconds=10))
            assert [m.replica_id for m in quorum.participants] == ["a"]
        await client.close()

    asyncio.run(run())
