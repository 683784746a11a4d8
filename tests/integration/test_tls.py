"""TLS and mutual TLS over real gRPC, real HTTPS and real handshakes, in one
process, with certificates made by the test (tests/certs.py)."""

from __future__ import annotations

import logging
import ssl
import time
import urllib.error
import urllib.request
from datetime import timedelta

import grpc
import pytest
import torch

from lighthouse import LighthouseClient, LighthouseServer
from lighthouse.rpc import tls
from lighthouse.rpc.address import url_to_target
from lighthouse.rpc.errors import LighthouseUnavailableError
from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc
from lighthouse.rpc.tls import TLSConfig
from tests.certs import Certs, make_certs
from tests.integration.test_manager import assert_identical, run_groups
from tests.waiting import wait_until
from torchft_like.checkpointing import HTTPTransport
from torchft_like.checkpointing.heal_source import HealSource
from torchft_like.checkpointing.http_fetch import Fetch, FetchTLSError
from torchft_like.manager.group.client import ManagerClient
from torchft_like.manager.group.group_request import QuorumRequest
from torchft_like.manager.group.server import ManagerServer

pytestmark = pytest.mark.timeout(90)
T = timedelta(seconds=10)
S = "s3cret-0123456789abcdef"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"), "job")


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Certs:
    """Another CA and node: what a process of another job (or an attacker) holds."""
    return make_certs(tmp_path_factory.mktemp("other"), "other")


def node(certs: Certs, client_auth: bool = False) -> TLSConfig:
    return TLSConfig(
        cert=str(certs.cert), key=str(certs.key), ca=str(certs.ca), client_auth=client_auth
    )


def ca_only(certs: Certs) -> TLSConfig:
    return TLSConfig(ca=str(certs.ca))


@pytest.fixture(params=[False, True], ids=["tls", "mtls"])
def lighthouse(request, certs):
    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=500,
        heartbeat_timeout_ms=1000,
        tls=node(certs, client_auth=request.param),
    )
    yield server
    server.shutdown()


# ---- configuration -------------------------------------------------------------


def test_a_key_without_a_certificate_is_refused_naming_both_settings(certs):
    with pytest.raises(ValueError) as e:
        TLSConfig(key=str(certs.key), ca=str(certs.ca))
    assert "key file (TORCHFT_TLS_KEY, --tls-key or TLSConfig.key) is set but no certificate" in (
        str(e.value)
    )
    assert "TORCHFT_TLS_CERT, --tls-cert" in str(e.value)


def test_a_missing_ca_file_is_refused_naming_the_variable_and_the_path(tmp_path):
    missing = tmp_path / "nope.pem"
    with pytest.raises(ValueError) as e:
        tls.tls_from_env({tls.CA_ENV: str(missing)})
    name = "CA file (TORCHFT_TLS_CA, --tls-ca or TLSConfig.ca)"
    assert f"cannot read the TLS {name} '{missing}'" in str(e.value)
    assert "No such file or directory; check the path" in str(e.value)


def test_an_unreadable_or_non_pem_ca_is_refused(tmp_path):
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=r"TORCHFT_TLS_CA.*is not a PEM file"):
        TLSConfig(ca=str(garbage))
    garbage.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    with pytest.raises(ValueError, match=r"TORCHFT_TLS_CA.*holds no valid PEM certificate"):
        TLSConfig(ca=str(garbage))


def test_a_key_that_does_not_belong_to_the_certificate_is_refused(certs, other):
    with pytest.raises(ValueError, match="check that the key belongs to the certificate"):
        TLSConfig(cert=str(certs.cert), key=str(other.key))


def test_client_auth_without_a_ca_and_empty_variables_are_refused(certs):
    with pytest.raises(ValueError, match=r"\(TORCHFT_TLS_CLIENT_AUTH, --tls-client-auth\) needs"):
        TLSConfig(cert=str(certs.cert), key=str(certs.key), client_auth=True)
    with pytest.raises(ValueError, match="TORCHFT_TLS_CERT is set but empty"):
        tls.tls_from_env({tls.CERT_ENV: ""})
    with pytest.raises(ValueError, match="TORCHFT_TLS_CLIENT_AUTH='yes': use 1"):
        tls.tls_from_env({tls.CA_ENV: str(certs.ca), tls.CLIENT_AUTH_ENV: "yes"})
    assert tls.tls_from_env({}) is None


def test_a_server_needs_a_certificate(certs):
    with pytest.raises(ValueError, match="the lighthouse cannot serve TLS without a certificate"):
        LighthouseServer(bind="127.0.0.1:0", min_replicas=1, tls=ca_only(certs))


# ---- lighthouse ------------------------------------------------------------------


def test_a_client_with_the_ca_reaches_the_lighthouse_over_tls(lighthouse, certs):
    assert lighthouse.address().startswith("https://127.0.0.1:")
    # Mutual TLS needs the client's certificate; plain TLS only the CA.
    config = node(certs) if lighthouse._tls.client_auth else ca_only(certs)
    client = LighthouseClient(lighthouse.address(), T, secret=None, tls=config)
    try:
        assert client.quorum("a", timedelta(seconds=20), step=1).replica_ids() == ("a",)
    finally:
        client.close()


def test_a_client_of_another_ca_is_refused_saying_the_certificate_is_not_trusted(lighthouse, other):
    client = LighthouseClient(lighthouse.address(), T, tls=node(other))
    try:
        with pytest.raises(LighthouseUnavailableError) as e:
            client.heartbeat("intruder")
    finally:
        client.close()
    text = str(e.value)
    assert f"cannot connect to lighthouse {lighthouse.address()} over TLS: TLS handshake" in text
    assert any(
        why in text
        for why in (
            "certificate verify failed",
            "unable to get local issuer",
            "self-signed certificate in certificate chain",  # the server sent its CA too
        )
    )
    assert "set TORCHFT_TLS_CA to the CA file that signed the servers' certificates" in text


def test_a_client_without_tls_is_told_to_configure_it(lighthouse):
    with pytest.raises(ValueError) as e:
        LighthouseClient(lighthouse.address(), T)
    assert "is https but this process has no TLS configuration: set TORCHFT_TLS_CA" in str(e.value)


def test_a_plaintext_call_to_a_tls_lighthouse_gets_nowhere(lighthouse):
    channel = grpc.insecure_channel(url_to_target(lighthouse.address()))
    try:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.LighthouseServiceStub(channel).Heartbeat(
                pb.LighthouseHeartbeatRequest(replica_id="plain"), timeout=3
            )
    finally:
        channel.close()
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert lighthouse.status()["replicas"] == []


def test_mutual_tls_refuses_a_client_without_a_certificate(certs):
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, tls=node(certs, True))
    client = LighthouseClient(server.address(), T, tls=ca_only(certs))
    try:
        with pytest.raises(LighthouseUnavailableError) as e:
            client.heartbeat("no-cert")
        assert "over TLS: TLS handshake failed" in str(e.value)
        assert "requires a client certificate (mutual TLS)" in str(e.value)
        assert "this process presents none" in str(e.value)
        assert server.status()["replicas"] == []
    finally:
        client.close()
        server.shutdown()


# ---- ManagerServer ---------------------------------------------------------------


def make_manager_server(lighthouse: LighthouseServer, config: TLSConfig) -> ManagerServer:
    return ManagerServer(
        replica_id="group:1",
        lighthouse_addr=lighthouse.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="store:1234",
        world_size=1,
        connect_timeout=T,
        tls=config,
    )


def test_a_manager_server_serves_tls_and_reaches_the_lighthouse_over_it(lighthouse, certs):
    config = node(certs, client_auth=lighthouse._tls.client_auth)
    server = make_manager_server(lighthouse, config)
    client = ManagerClient(server.address(), T, tls=config)
    try:
        assert server.address().startswith("https://127.0.0.1:")
        result = client.quorum(QuorumRequest(group_rank=0, step=3, checkpoint_metadata="m"), T)
        assert result.replica_world_size == 1 and result.max_step == 3
        assert client.checkpoint_metadata(0, T) == "m"
    finally:
        client.close()
        server.shutdown()


def test_a_manager_server_with_another_ca_fails_at_start_at_once(lighthouse, other):
    with pytest.raises(LighthouseUnavailableError) as e:
        make_manager_server(lighthouse, node(other))
    assert f"cannot connect to lighthouse {lighthouse.address()} over TLS" in str(e.value)


def test_a_manager_client_of_another_ca_is_refused(lighthouse, certs, other):
    server = make_manager_server(lighthouse, node(certs, lighthouse._tls.client_auth))
    client = ManagerClient(server.address(), T, tls=node(other))
    try:
        with pytest.raises(LighthouseUnavailableError, match="over TLS: TLS handshake failed"):
            client.checkpoint_metadata(0, T)
    finally:
        client.close()
        server.shutdown()


# ---- checkpoint server (HTTPS) ---------------------------------------------------


@pytest.fixture
def make_transport():
    made: list[HTTPTransport] = []

    def make(config: TLSConfig | None, **kwargs) -> HTTPTransport:
        made.append(HTTPTransport(timeout=T, hostname="127.0.0.1", tls=config, **kwargs))
        return made[-1]

    yield make
    for transport in made:
        transport.shutdown()


@pytest.mark.parametrize("client_auth", [False, True])
@pytest.mark.parametrize("num_chunks", [1, 4])
def test_a_checkpoint_travels_over_https(make_transport, certs, client_auth, num_chunks):
    source = make_transport(node(certs, client_auth))
    receiver = make_transport(node(certs, client_auth), num_chunks=num_chunks)
    state = {"w": torch.arange(100_000.0), "step": 5}
    source.send_checkpoint([1], 5, state, T)
    assert source.metadata().startswith("https://127.0.0.1:")
    got = receiver.recv_checkpoint(0, source.metadata(), 5, T)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 5


def test_a_striped_checkpoint_travels_over_mutual_tls_with_a_secret(make_transport, certs):
    sources = [make_transport(node(certs, True), secret=S) for _ in range(3)]
    receiver = make_transport(node(certs, True), secret=S)
    state = {"w": torch.arange(300_000.0), "b": torch.ones(3), "step": 5}
    for source in sources:
        source.send_checkpoint([3], 5, state, T)
    got = receiver.recv_checkpoint_striped([(i, s.metadata()) for i, s in enumerate(sources)], 5, T)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 5
    report = receiver.last_stripe_report
    assert report is not None and not report.errors and all(report.bytes_by_source)


def test_a_fetch_trusting_another_ca_fails_at_once_saying_why(make_transport, certs, other):
    source, receiver = make_transport(node(certs)), make_transport(node(other))
    source.send_checkpoint([1], 5, {"w": torch.ones(3)}, T)
    # Final: not retried until the 200 s timeout (the test's own timeout is shorter).
    with pytest.raises(FetchTLSError) as e:
        receiver.recv_checkpoint(0, source.metadata(), 5, timedelta(seconds=200))
    assert f"could not fetch step 5 from replica rank 0 at {source.metadata()} over TLS" in str(
        e.value
    )
    assert "CERTIFICATE_VERIFY_FAILED" in str(e.value) and "set TORCHFT_TLS_CA" in str(e.value)


def test_a_fetch_without_a_client_certificate_is_refused_under_mutual_tls(
    make_transport, certs, caplog
):
    """A receiver always serves too (it needs a certificate); the fetch
    itself is what a process holding only the CA would do."""
    caplog.set_level(logging.WARNING, logger="lighthouse.rpc.auth")
    source = make_transport(node(certs, True))
    source.send_checkpoint([1], 5, {"w": torch.ones(3)}, T)
    fetch = Fetch(HealSource.parse(0, source.metadata()), 5, time.monotonic() + 10, None,
                  ca_only(certs).client_context())  # fmt: skip
    with pytest.raises(ssl.SSLError) as e:
        fetch.run(1)
    # The client sees the connection end (an alert or an EOF); the server says
    # why, from its handler thread, which may log after the client has given up.
    assert e.value is not None

    def server_said_why() -> bool:
        return any(
            r.getMessage().startswith(
                "refused a TLS connection from 127.0.0.1: TLS handshake failed: "
                "PEER_DID_NOT_RETURN_A_CERTIFICATE"
            )
            for r in caplog.records
        )

    wait_until(
        server_said_why,
        5,
        lambda: f"the server's refusal; it logged {[r.getMessage() for r in caplog.records]}",
    )


def test_a_plain_http_request_to_the_https_server_fails_and_the_server_serves_on(
    make_transport, certs
):
    source = make_transport(node(certs))
    plain_url = "http://" + source.metadata().split("://", 1)[1] + "0"
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(plain_url, timeout=5)
    context = ssl.create_default_context(cafile=str(certs.ca))
    with pytest.raises(urllib.error.HTTPError) as e:  # 503: nothing staged, but it answered
        urllib.request.urlopen(source.metadata() + "0", timeout=5, context=context)
    assert e.value.code == 503


def test_a_receiver_without_tls_is_told_to_configure_it(make_transport, certs):
    source, receiver = make_transport(node(certs)), make_transport(None)
    with pytest.raises(ValueError, match="is https but this process has no TLS configuration"):
        receiver.recv_checkpoint(0, source.metadata(), 5, T)


# ---- Manager: a whole run ------------------------------------------------------


def test_a_run_over_mutual_tls_with_a_secret_trains_heals_over_https_and_commits(
    certs, monkeypatch, caplog
):
    """Two groups of two ranks; the Managers read TORCHFT_TLS_* and the secret
    from the environment. Group 1 starts from other weights and heals from
    group 0 over HTTPS (init_sync); rank 1 reaches rank 0's ManagerServer
    over gRPC with TLS."""
    caplog.set_level(logging.INFO, logger="torchft_like.checkpointing.http_transport")
    monkeypatch.setenv(tls.CERT_ENV, str(certs.cert))
    monkeypatch.setenv(tls.KEY_ENV, str(certs.key))
    monkeypatch.setenv(tls.CA_ENV, str(certs.ca))
    monkeypatch.setenv(tls.CLIENT_AUTH_ENV, "1")
    monkeypatch.setenv("TORCHFT_SECRET", S)
    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=2,  # both groups: see test_manager.lighthouse_of_two
        join_timeout_ms=500,
        heartbeat_timeout_ms=1000,
        secret=S,
        tls=node(certs, True),
    )
    try:
        results = run_groups(server, 2, steps=3, group_world_size=2)
    finally:
        server.shutdown()
    for rank in range(2):
        assert results[0][rank]["step"] == 3
        assert all(committed for _, committed in results[0][rank]["commits"])
        assert_identical(results[0][rank], results[1][rank])
    received = [r.getMessage() for r in caplog.records if r.getMessage().startswith("received")]
    assert received and all(" from https://127.0.0.1:" in m for m in received)
