"""nghttp2's h2load drives the lean lighthouse with real gRPC calls: an HTTP/2 client written
independently of grpcio (and of our own), many streams at once on each connection, so that
the lean server's framing and flow control meet a second implementation's, not only the
one they were written against.

Opt-in (`-m integration`; scripts/integration.sh installs h2load, Debian's nghttp2-client).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request

import pytest

from lighthouse.rpc.proto import torchft_pb2 as pb
from tests.e2e.test_lighthouse_cli import lighthouse_command
from tests.procs import wait_for_line

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
H2LOAD = shutil.which("h2load")
CALLS = 2000


@pytest.mark.skipif(
    H2LOAD is None, reason="h2load is not installed (Debian/Ubuntu: apt-get install nghttp2-client)"
)
def test_h2load_heartbeats_on_the_lean_lighthouse_all_succeed(children, tmp_path):
    proc = children.spawn(
        lighthouse_command()
        + ["--min-replicas", "1", "--bind", "127.0.0.1:0", "--http-bind", "127.0.0.1:0",
           "--rpc-server", "lean"]
    )  # fmt: skip
    http = wait_for_line(proc, r"status page on (http://\S+)", timeout=15).group(1)
    grpc_addr = wait_for_line(proc, r"listening on (http://\S+)", timeout=15).group(1)
    body = tmp_path / "heartbeat.grpc"
    message = pb.LighthouseHeartbeatRequest(replica_id="h2load").SerializeToString()
    body.write_bytes(b"\x00" + len(message).to_bytes(4, "big") + message)
    out = subprocess.run(
        [H2LOAD, "-n", str(CALLS), "-c", "10", "-m", "10", "-d", str(body),
         "-H", "content-type: application/grpc", "-H", "te: trailers",
         f"{grpc_addr}/torchft.LighthouseService/Heartbeat"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    requests = re.search(
        r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
        r"(\d+) errored, (\d+) timeout",
        out.stdout,
    )
    assert requests, out.stdout
    assert requests.groups() == (str(CALLS),) * 4 + ("0",) * 3, out.stdout
    statuses = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out.stdout)
    assert statuses and statuses.groups() == (str(CALLS), "0", "0", "0"), out.stdout
    # HTTP 200 says nothing of the gRPC status (in the trailers, which h2load does not
    # read): every call was a heartbeat the lighthouse took.
    with urllib.request.urlopen(http + "/metrics", timeout=5) as r:
        heartbeats = re.search(
            r'^torchft_lighthouse_heartbeats_total\{job="default"\} (\S+)$', r.read().decode(), re.M
        )
    assert heartbeats and float(heartbeats.group(1)) == CALLS
    assert proc.poll() is None
