"""Safe defaults over real sockets: servers listen where they advertise,
Kill needs the secret, and a server open to the network without one says so."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
from datetime import timedelta
from urllib.parse import urlsplit

import pytest
from torch.distributed import TCPStore

from lighthouse import LighthouseServer
from lighthouse.rpc import auth
from lighthouse.rpc.address import BIND_HOST_ENV
from torchft_like import Manager, ProcessGroupGloo
from torchft_like.checkpointing import HTTPTransport

pytestmark = pytest.mark.timeout(90)
T = timedelta(seconds=10)


def accepts(host: str, port: int) -> bool:
    """Whether a TCP connection to host:port is accepted. 127.0.0.2 is a
    loopback address too, but a socket bound to 127.0.0.1 does not hear it."""
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except ConnectionRefusedError:
        return False


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


@pytest.fixture
def no_secret(monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(BIND_HOST_ENV, raising=False)


@pytest.fixture
def lighthouse():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    yield server
    server.shutdown()


def test_the_checkpoint_server_listens_only_on_its_advertised_host():
    transport = HTTPTransport(timeout=T, hostname="127.0.0.1")
    try:
        port = port_of(transport.metadata())
        assert accepts("127.0.0.1", port)
        assert not accepts("127.0.0.2", port)
    finally:
        transport.shutdown()


def test_the_checkpoint_server_listens_on_all_interfaces_when_asked():
    transport = HTTPTransport(timeout=T, hostname="127.0.0.1", bind_host="0.0.0.0")
    try:
        assert accepts("127.0.0.2", port_of(transport.metadata()))
    finally:
        transport.shutdown()


def make_manager(lighthouse: LighthouseServer, store: TCPStore) -> Manager:
    return Manager(
        pg=ProcessGroupGloo(timeout=T),
        load_state_dict=lambda _: None,
        state_dict=lambda: {},
        min_replica_size=1,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse.address(),
        hostname="127.0.0.1",
        connect_timeout=T,
        exit_with_parent=False,
    )


@pytest.mark.parametrize("bind_host, heard_on_other", [(None, False), ("0.0.0.0", True)])
def test_a_managers_servers_listen_on_its_hostname_unless_the_bind_host_is_set(
    lighthouse, no_secret, monkeypatch, bind_host, heard_on_other
):
    if bind_host is not None:
        monkeypatch.setenv(BIND_HOST_ENV, bind_host)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = make_manager(lighthouse, store)
    try:
        for url in (manager._manager_server.address(), manager._checkpoint_transport.metadata()):
            assert accepts("127.0.0.1", port_of(url))
            assert accepts("127.0.0.2", port_of(url)) is heard_on_other, url
    finally:
        manager.shutdown()


def test_a_lighthouse_url_without_a_port_fails_the_manager_naming_the_variable(
    no_secret, monkeypatch
):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with pytest.raises(ValueError, match="TORCHFT_LIGHTHOUSE") as e:
        Manager(
            pg=ProcessGroupGloo(timeout=T),
            load_state_dict=lambda _: None,
            state_dict=lambda: {},
            min_replica_size=1,
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=store.port,
            hostname="127.0.0.1",
            exit_with_parent=False,
        )
    assert "'http://localhost' has no valid port" in str(e.value)


KILL_WITHOUT_SECRET = """
import time
from urllib.parse import urlsplit
from lighthouse import LighthouseServer
from torchft_like.manager.group.client import ManagerClient
from torchft_like.manager.group.server import ManagerServer
lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
server = ManagerServer(replica_id="g:1", lighthouse_addr=lighthouse.address(),
                       hostname="127.0.0.1", bind="127.0.0.1:0", store_addr="x:1", world_size=1)
try:
    ManagerClient(server.address()).kill("a stray script")
except PermissionError as e:
    print("refused:", e, flush=True)
time.sleep(0.5)  # a Kill obeyed would end the process 0.1 s after answering
print("still alive", flush=True)
"""


def test_the_kill_rpc_is_refused_when_the_job_has_no_secret(no_secret):
    proc = subprocess.run(
        [sys.executable, "-c", KILL_WITHOUT_SECRET], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused: Kill at" in proc.stdout
    assert "has no shared secret, so it cannot tell who asks" in proc.stdout
    assert "TORCHFT_SECRET_FILE" in proc.stdout
    assert "PERMISSION_DENIED" not in proc.stdout  # it came back as PermissionError
    assert "still alive" in proc.stdout


@pytest.mark.parametrize("bind, warns", [("127.0.0.1:0", False), ("0.0.0.0:0", True)])
def test_a_lighthouse_without_a_secret_off_loopback_warns_loudly(caplog, bind, warns):
    with caplog.at_level(logging.WARNING, logger="lighthouse"):
        LighthouseServer(bind=bind, min_replicas=1).shutdown()
    warned = [r for r in caplog.records if "SECURITY: the lighthouse listens" in r.getMessage()]
    assert bool(warned) is warns
