"""TLS as an operator meets it: the lighthouse CLI's --tls-* flags and torchrun
jobs configured through TORCHFT_TLS_*, as real processes."""

from __future__ import annotations

import subprocess

import pytest

from lighthouse.rpc import auth, tls
from tests.certs import Certs, make_certs
from tests.e2e.test_access_control import start_group
from tests.e2e.test_kill_and_recover import finals
from tests.e2e.test_lighthouse_cli import lighthouse_command
from tests.procs import wait_for_line

pytestmark = pytest.mark.timeout(150)
S = "e2e-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"), "job")


def tls_env(certs: Certs) -> dict[str, str]:
    return {
        tls.CERT_ENV: str(certs.cert),
        tls.KEY_ENV: str(certs.key),
        tls.CA_ENV: str(certs.ca),
        tls.CLIENT_AUTH_ENV: "1",
        # The test certificates are valid for 127.0.0.1, not this machine's name.
        "TORCHFT_HOSTNAME": "127.0.0.1",
    }


def test_torchrun_jobs_over_mutual_tls_train_and_heal_and_another_ca_is_turned_away(
    children, tmp_path, certs, tmp_path_factory
):
    """Two groups train to the end bit-identical, one healing from the other
    over HTTPS at step 0; a group holding another CA's certificate exits at
    its first connection saying the handshake failed and what to set."""
    secret_file = tmp_path / "secret"
    secret_file.write_text(S + "\n")
    proc = children.spawn(
        lighthouse_command()
        + ["--min-replicas", "2", "--bind", "127.0.0.1:0", "--http-bind", "",
           "--secret-file", str(secret_file), "--tls-cert", str(certs.cert),
           "--tls-key", str(certs.key), "--tls-ca", str(certs.ca), "--tls-client-auth"]
    )  # fmt: skip
    lighthouse = wait_for_line(proc, r"listening on (https://\S+)", timeout=15).group(1)
    wait_for_line(proc, r"transport: TLS, client certificates required", timeout=15)
    env = {**tls_env(certs), auth.SECRET_FILE_ENV: str(secret_file)}
    groups = [start_group(children, tmp_path, lighthouse, g, env) for g in range(2)]
    other = make_certs(tmp_path_factory.mktemp("other"), "other")
    intruder_env = {**tls_env(other), auth.SECRET_FILE_ENV: str(secret_file),
                    "NUM_REPLICA_GROUPS": "3"}  # fmt: skip
    intruder = start_group(children, tmp_path, lighthouse, 2, intruder_env)
    assert [g.wait(timeout=120) for g in groups] == [0, 0]
    assert intruder.wait(timeout=30) != 0
    a, b = finals(tmp_path)
    assert a["step"] == b["step"] == 15 and a["hash"] == b["hash"]
    logs = [(tmp_path / f"group{g}.log").read_text() for g in range(3)]
    assert sum("healing from replica rank" in log for log in logs[:2]) == 1
    assert sum("received step 0 from https://127.0.0.1:" in log for log in logs[:2]) == 1
    assert f"cannot connect to lighthouse {lighthouse} over TLS: TLS handshake failed" in logs[2]
    assert "set TORCHFT_TLS_CA" in logs[2]


def test_the_lighthouse_cli_exits_with_one_clear_line_on_a_key_without_a_certificate(certs):
    out = subprocess.run(
        lighthouse_command() + ["--min-replicas", "1", "--http-bind", "", "--tls-key",
                                str(certs.key)],
        capture_output=True,
        text=True,
        timeout=30,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.startswith("torchft-lighthouse: error: TLS key file (TORCHFT_TLS_KEY, ")
    assert "is set but no certificate file (TORCHFT_TLS_CERT, --tls-cert" in out.stderr
    assert "Traceback" not in out.stderr
