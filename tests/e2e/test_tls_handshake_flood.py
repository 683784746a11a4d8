"""A TLS lighthouse under a handshake flood: 1,000 connections from one host that
connect and never say a word. Each holds a file descriptor until the server drops it;
asyncio's own TLS server gives a handshake 60 s and counts none of them, so ~17 such
connects a second would exhaust 1,024 descriptors. Ours counts each from accept (the
connection cap, and its host's share of it) and gives its handshake 5 s
(lighthouse.rpc.h2.tls_accept). grpcio's server is the reference (with
H2_ATTACK_REFERENCE=1): where it fails, the case is an xfail."""

from __future__ import annotations

import socket
import ssl
import time

import psutil
import pytest

from tests.certs import make_certs
from tests.e2e.test_http2_attacks import SERVERS
from tests.e2e.test_lighthouse_cli import lighthouse_command
from tests.procs import wait_for_line
from tools import h2_peer

pytestmark = pytest.mark.timeout(90)
CONNECTS = 1000
CAP = 1024 - 64
"""The connection cap of a lighthouse whose descriptor limit is 1,024 (the default)."""
SETTLED_S = 10.0


def _tls_handshake(port: int, ca: str) -> str:
    """A healthy host's TLS handshake (from 127.0.0.1): the ALPN protocol it agreed."""
    context = ssl.create_default_context(cafile=ca)
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return tls.selected_alpn_protocol() or ""


@pytest.mark.parametrize("server", SERVERS)
def test_silent_tls_connects_hold_at_most_the_cap_and_nothing_after_ten_seconds(
    children, tmp_path, server
):
    certs = make_certs(tmp_path / "certs", "job")
    proc = children.spawn(
        ["bash", "-c", 'ulimit -n 1024 && exec "$@"', "lighthouse"] + lighthouse_command()
        + ["--min-replicas", "1", "--bind", "127.0.0.1:0", "--http-bind", "",
           "--rpc-server", server, "--tls-cert", str(certs.cert), "--tls-key", str(certs.key)]
    )  # fmt: skip
    url = wait_for_line(proc, r"listening on (https://\S+)", timeout=30).group(1)
    port = int(url.rsplit(":", 1)[1])
    lighthouse = psutil.Process(proc.pid)
    before = lighthouse.num_fds()
    h2_peer.raise_nofile(CONNECTS + 256)
    silent: list[socket.socket] = []
    peak, refused = before, 0
    try:
        for _ in range(CONNECTS):
            sock = socket.socket()
            sock.bind((h2_peer.ATTACKER_HOST, 0))
            try:
                sock.connect(("127.0.0.1", port))
            except OSError:
                refused += 1
                sock.close()
                continue
            silent.append(sock)
            if len(silent) % 100 == 0:
                peak = max(peak, lighthouse.num_fds())
        flooded = time.monotonic()
        peak = max(peak, lighthouse.num_fds())
        alpn = _tls_handshake(port, str(certs.ca))
        held = peak - before
        failures = []
        if held > CAP:
            failures.append(f"{held} descriptors held by {CONNECTS} silent connects (cap {CAP})")
        if alpn != "h2":
            failures.append(f"a healthy handshake during the flood agreed {alpn!r}, not h2")
        if not failures:
            time.sleep(max(0.0, flooded + SETTLED_S - time.monotonic()))
            left = lighthouse.num_fds() - before
            if left > 2:
                failures.append(f"{left} descriptors still held {SETTLED_S:.0f} s after")
        print(f"{server}: {held} descriptors at the peak, {refused} connects refused")
    finally:
        for sock in silent:
            sock.close()
    if failures:
        why = f"{server}: " + "; ".join(failures)
        if server == "grpcio":
            pytest.xfail(f"the reference fails too: {why}")
        pytest.fail(why)
