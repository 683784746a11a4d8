"""Hot spares against a real lighthouse: a spare takes the name of a group
that died, a restart gets its own name back unless a spare took it, and a
lighthouse without spares (pytorch/torchft's) says so."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from lighthouse import LighthouseClient, LighthouseServer, QuorumError, QuorumTimeoutError
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

HEARTBEAT_TIMEOUT_MS = 400


@pytest.fixture(params=["lean", "grpcio"])
def lighthouse(request):
    """A lighthouse on each server runtime: a spare's call waits parked on either."""
    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=1,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
        rpc_server=request.param,
    )
    yield server
    server.shutdown()


def take_in_thread(client: LighthouseClient, spare_id: str, wanted: str = "") -> dict:
    out: dict = {}

    def run() -> None:
        try:
            out["group"] = client.take_replica_group(spare_id, wanted, timedelta(seconds=20))
            out["at"] = time.monotonic()
        except Exception as e:
            out["error"] = e

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def test_a_spare_becomes_the_group_that_died(lighthouse):
    client = LighthouseClient(lighthouse.address())
    client.heartbeat("g0:a")
    client.heartbeat("g1:b")
    ranks = [take_in_thread(client, "spare-1"), take_in_thread(client, "spare-1")]
    time.sleep(0.2)  # a window in which no spare may be promoted: every group lives
    assert all("group" not in r for r in ranks), "a spare was promoted while every group lived"
    died_at = time.monotonic()
    for _ in range(15):  # g0 lives on; g1 falls silent
        client.heartbeat("g0:a")
        time.sleep(0.1)
    for rank in ranks:
        rank["thread"].join(10)
    # Both ranks of the spare, one name: the silent group's.
    assert [r.get("group") for r in ranks] == ["g1", "g1"], ranks
    assert all(r["at"] - died_at < HEARTBEAT_TIMEOUT_MS / 1000 + 0.5 for r in ranks)
    spares = lighthouse.status()["spares"]
    assert spares == []
    # The promoted spare joins under that name: not refused as a twin.
    client.heartbeat("g1:spare-1")


def test_a_restart_gets_its_own_name_back_unless_a_spare_took_it(lighthouse):
    client = LighthouseClient(lighthouse.address())
    # A group's first start: its name is free.
    assert client.take_replica_group("run-a", "g0", timeout=timedelta(seconds=5)) == "g0"
    alive = threading.Event()
    alive.set()

    def heartbeats() -> None:
        while alive.is_set():
            client.heartbeat("g0:first")
            time.sleep(0.05)  # a heartbeat's pace

    client.heartbeat("g0:first")  # live before the thread keeps it so
    threading.Thread(target=heartbeats, daemon=True).start()
    # A second process wanting the live name waits as a spare...
    with pytest.raises(QuorumTimeoutError, match="no replica group"):
        client.take_replica_group("run-b", "g0", timeout=timedelta(seconds=1))
    waiting = take_in_thread(client, "run-b", "g0")
    wait_until(
        lambda: [s["spare_id"] for s in lighthouse.status()["spares"]] == ["run-b"],
        10,
        "run-b to wait as a spare",
    )
    assert "group" not in waiting
    # ...and takes the name once its holder is dead.
    alive.clear()
    waiting["thread"].join(5)
    assert waiting.get("group") == "g0", waiting


def test_a_lighthouse_without_spares_is_named(tmp_path):
    torchft = pytest.importorskip("torchft._torchft", reason="pytorch/torchft (bench extra)")
    server = torchft.LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        client = LighthouseClient(server.address())
        with pytest.raises(QuorumError, match="does not serve hot spares"):
            client.take_replica_group("s", "g0", timeout=timedelta(seconds=5))
    finally:
        server.shutdown()
