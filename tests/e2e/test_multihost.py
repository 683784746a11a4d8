"""End to end across machines: the lighthouse and two replica groups each in a
network namespace of its own, joined by veth links to a bridge in a fifth
namespace. Every group advertises its namespace's address, so the store, the
ManagerServer, the checkpoint server and gloo all cross the links; then a
SIGKILL of one group, a restart in its namespace and a heal over the network.

Needs root and `ip netns`; nothing is added to the root namespace, and every
namespace made (names start with tfmh-<pid>-) is deleted, also on failure.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.test_kill_and_recover import finals, last_step, steps, stop_at
from tests.procs import PYTHON, REPO, Children, wait_for_line
from tests.waiting import wait_until
from tools.procs import kill_tree

pytestmark = pytest.mark.timeout(240)

HOSTS = ("lh", "g0", "g1")
ADDRESSES = {
    "ipv4": ("10.77.0.{}", "24"),  # a private range, only inside the namespaces
    "ipv6": ("fd00:77::{}", "64"),  # unique local (ULA), never routed out
}


def ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


@dataclass
class Network:
    """Namespaces by host name, and each host's address (IPv6 without brackets)."""

    namespaces: dict[str, str]
    addresses: dict[str, str]

    def command(self, host: str, args: list[str]) -> list[str]:
        """`args` run in `host`'s namespace, with this worktree on the path."""
        return ["ip", "netns", "exec", self.namespaces[host], "env", f"PYTHONPATH={REPO}", *args]

    def url(self, host: str, port: int) -> str:
        addr = self.addresses[host]
        return f"http://[{addr}]:{port}" if ":" in addr else f"http://{addr}:{port}"


def build_network(family: str) -> tuple[Network, list[str]]:
    """Creates the switch namespace and one namespace per host; returns the
    network and every namespace name made so far (also when it fails)."""
    prefix = f"tfmh-{os.getpid()}-{secrets.token_hex(2)}"
    made: list[str] = []
    pattern, length = ADDRESSES[family]
    switch = f"{prefix}-sw"
    ip("netns", "add", switch)
    made.append(switch)
    try:
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        namespaces, addresses = {}, {}
        for index, host in enumerate(HOSTS, start=1):
            ns = f"{prefix}-{host}"
            ip("netns", "add", ns)
            made.append(ns)
            # Both veth ends are born inside namespaces: none in the root one.
            ip("-n", switch, "link", "add", host, "type", "veth", "peer", "name", "eth0",
               "netns", ns)  # fmt: skip
            ip("-n", switch, "link", "set", host, "master", "br0", "up")
            addr = pattern.format(index)
            extra = ["nodad"] if family == "ipv6" else []  # usable at once
            ip("-n", ns, "link", "set", "lo", "up")  # torchrun's own rendezvous
            ip("-n", ns, "addr", "add", f"{addr}/{length}", "dev", "eth0", *extra)
            ip("-n", ns, "link", "set", "eth0", "up")
            namespaces[host], addresses[host] = ns, addr
    except Exception:
        delete_namespaces(made)
        raise
    return Network(namespaces, addresses), made


def delete_namespaces(names: list[str]) -> None:
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in names if n in left], f"namespaces left behind: {left}"


@pytest.fixture(params=["ipv4", "ipv6"])
def network(request, children: Children):
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` for network namespaces")
    try:
        net, made = build_network(request.param)
    except RuntimeError as e:
        pytest.skip(f"network namespaces unavailable here: {e}")
    try:
        yield net
    finally:
        children.kill_all()  # no process may hold a namespace being deleted
        delete_namespaces(made)


def start_lighthouse(children: Children, net: Network) -> str:
    addr = net.addresses["lh"]
    bind = f"[{addr}]:0" if ":" in addr else f"{addr}:0"
    proc = children.spawn(
        net.command("lh", [PYTHON, "-m", "lighthouse", "--min-replicas", "1", "--bind", bind,
                           "--http-bind", "", "--heartbeat-timeout-ms", "1000",
                           "--join-timeout-ms", "1000"])
    )  # fmt: skip
    return wait_for_line(proc, r"listening on (http://\S+)", timeout=30).group(1)


def start_group(children: Children, net: Network, tmp_path: Path, lighthouse: str, group: int):
    host = f"g{group}"
    return children.spawn(
        net.command(host, [PYTHON, "-m", "torch.distributed.run", "--standalone",
                           "--local-addr", net.addresses[host], "--nproc_per_node", "1",
                           "examples/train_ddp.py", "--steps", "100000", "--hidden", "64",
                           "--stop-file", str(tmp_path / f"group{group}.stop"),
                           "--step-sleep", "0.05",
                           "--log-json", str(tmp_path / f"group{group}.jsonl")]),
        log=tmp_path / f"group{group}.log",
        env={"TORCHFT_LIGHTHOUSE": lighthouse, "TORCHFT_HOSTNAME": net.addresses[host],
             "REPLICA_GROUP_ID": str(group), "NUM_REPLICA_GROUPS": "2",
             "TORCHFT_TIMEOUT_SEC": "5"},
    )  # fmt: skip


def test_a_group_killed_on_one_host_heals_from_another_over_the_network(
    network, children, tmp_path
):
    net = network
    lighthouse = start_lighthouse(children, net)
    assert lighthouse == net.url("lh", int(lighthouse.rsplit(":", 1)[1]))
    survivor = start_group(children, net, tmp_path, lighthouse, 0)
    victim = start_group(children, net, tmp_path, lighthouse, 1)
    log0, log1 = tmp_path / "group0.jsonl", tmp_path / "group1.jsonl"

    wait_until(
        lambda: sum(r["participants"] == 2 and r["committed"] for r in steps(log1)) >= 10,
        120,
        "both groups to train together across the network",
    )
    assert not kill_tree(victim.pid), "the victim's processes survived SIGKILL"
    killed_at = time.time()
    victim = start_group(children, net, tmp_path, lighthouse, 1)
    wait_until(
        lambda: any(r["t"] > killed_at and r["committed"] for r in steps(log1)),
        120,
        "the restarted group to commit a step",
    )
    final = last_step(log0) + 10
    for group in (0, 1):
        stop_at(tmp_path, group, final)
    assert survivor.wait(timeout=60) == 0
    assert victim.wait(timeout=60) == 0

    after_restart = [r for r in steps(log1) if r["t"] > killed_at]
    assert after_restart[0]["healed"], "the restarted group did not heal first"
    a, b = finals(tmp_path)
    assert a["step"] == b["step"] == final
    assert a["hash"] == b["hash"], "replicas are not bit-identical at the same step"
    # Each group told its peers its own namespace's address, and the restarted
    # group healed from the survivor's: the transfer crossed the links.
    survivor_server = net.url("g0", 0).rsplit(":", 1)[0]
    text0, text1 = (tmp_path / "group0.log").read_text(), (tmp_path / "group1.log").read_text()
    assert f"manager ready, server {survivor_server}:" in text0, text0[-3000:]
    assert f"manager ready, server {net.url('g1', 0).rsplit(':', 1)[0]}:" in text1
    healed = re.findall(r"healing from replica rank \d+ \((\S+)\) at step", text1)
    assert healed and all(src.startswith(survivor_server + ":") for src in healed), healed
