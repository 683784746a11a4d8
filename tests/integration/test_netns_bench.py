"""bench._netns: the throwaway network of bench.transfer --netns."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from bench import _netns

PREFIX = "tftltest-"  # not the benchmark's: never touches a running benchmark's network
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network namespaces need root and iproute2",
)


def test_without_root_it_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(_netns.NetnsUnavailable, match="needs root; run it as root"):
        _netns.check_available()


@needs_root
@pytest.mark.timeout(30)
def test_hosts_reach_each_other_at_the_rate_and_nothing_is_left_behind():
    subprocess.run(["ip", "netns", "add", PREFIX + "crashed"], check=True)  # a crashed run's
    root_links = link_names()
    with _netns.Network({"a": "100mbit", "b": None}, prefix=PREFIX) as net:
        assert sorted(_netns.ours(PREFIX)) == [PREFIX + "a", PREFIX + "b", PREFIX + "hub"]
        if shutil.which("ping") is not None:
            ping = subprocess.run([*net.exec("a"), "ping", "-c", "1", "-W", "2",
                                   net.address["b"]], capture_output=True, text=True)  # fmt: skip
            assert ping.returncode == 0, f"a cannot reach b: {ping.stdout} {ping.stderr}"
        qdisc = subprocess.run([*net.exec("a"), "tc", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert "tbf" in qdisc and "100Mbit" in qdisc
        assert "tbf" not in subprocess.run([*net.exec("b"), "tc", "qdisc", "show", "dev", "eth0"],
                                           capture_output=True, text=True).stdout  # fmt: skip
        assert not {n for n in link_names() - root_links if n.startswith(("v", "eth", "br"))}
    assert _netns.ours(PREFIX) == []


def link_names() -> set[str]:
    """Names of the root namespace's links."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}
