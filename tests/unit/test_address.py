"""Address rules: what counts as loopback, URLs without a port, the no-secret warning."""

from __future__ import annotations

import pytest

from lighthouse.client import lighthouse_target
from lighthouse.rpc import auth
from lighthouse.rpc.address import is_loopback, loopback_advertisement_warning, url_to_target


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("", False),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("no-such-host.invalid", False),
    ],
)
def test_only_hosts_that_resolve_to_loopback_alone_count_as_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("url", ["http://localhost", "http://host:", "http://host:http", "host"])
def test_a_lighthouse_url_without_a_port_names_the_variable_and_the_fix(url):
    with pytest.raises(ValueError) as e:
        lighthouse_target(url)
    text = str(e.value)
    assert repr(url) in text
    assert "TORCHFT_LIGHTHOUSE" in text
    assert "e.g. http://lighthouse-host:29510" in text
    assert "bind address" not in text


def test_a_url_with_a_port_becomes_a_grpc_target():
    assert url_to_target("http://h:1/") == "h:1"
    assert url_to_target("[::1]:29510") == "[::1]:29510"
    with pytest.raises(ValueError, match="brackets"):
        url_to_target("http://::1:29510")


def test_only_a_server_without_a_secret_off_loopback_warns():
    assert auth.exposure_warning("s", "0.0.0.0", "lighthouse") is None
    assert auth.exposure_warning(None, "127.0.0.1", "lighthouse") is None
    text = auth.exposure_warning(None, "::", "manager server")
    assert text is not None
    assert "manager server listens on all interfaces without a shared secret" in text
    assert "TORCHFT_SECRET_FILE" in text


@pytest.mark.parametrize(
    "hostname, lighthouse, warned",
    [
        ("localhost", "http://10.1.2.3:29510", True),  # peers elsewhere told "localhost"
        ("127.0.1.1", "http://[2001:db8::1]:29510", True),
        ("localhost", "http://127.0.0.1:29510", False),  # a one-machine job
        ("10.1.2.4", "http://10.1.2.3:29510", False),
        ("10.1.2.4", "http://localhost:29510", False),
    ],
)
def test_a_loopback_name_is_flagged_only_in_a_job_that_spans_machines(hostname, lighthouse, warned):
    warning = loopback_advertisement_warning(hostname, lighthouse)
    assert (warning is not None) is warned
    if warned:
        assert "TORCHFT_HOSTNAME" in warning and hostname in warning
