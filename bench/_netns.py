"""A throwaway test network of Linux network namespaces with rate-limited links.

One namespace per host (the peers and the receiver) plus a hub namespace
holding a bridge; each host is joined to the bridge by a veth pair, and a
host's link may be capped with `tc` (a token bucket on the host's side,
which limits what it sends). Nothing is created in the root namespace:
every veth is made inside the hub and its other end moved straight into
its host, and deleting the namespaces deletes every link with them.

All names start with PREFIX, so `cleanup` also removes what a crashed run
left behind. Needs root and iproute2 (`ip`, `tc`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

PREFIX = "tftlbench-"
SUBNET = "10.213.7"


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, or no iproute2)."""


def check_available() -> None:
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsUnavailable(f"--netns needs iproute2's {' and '.join(missing)} on PATH")
    if os.geteuid() != 0:
        raise NetnsUnavailable(
            "--netns creates network namespaces and tc rate limits, which needs root; "
            "run it as root, or drop --netns"
        )


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def _tc(ns: str, *args: str) -> None:
    done = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} in {ns} failed: {done.stderr.strip()}")


def ours(prefix: str = PREFIX) -> list[str]:
    """Namespaces named with `prefix` that exist now (this run's or a crashed one's)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def cleanup(prefix: str = PREFIX) -> None:
    """Deletes every namespace named with `prefix`, and with them their links."""
    for ns in ours(prefix):
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


@dataclass
class Network:
    """Hosts on one bridge. `address[name]` is the host's IPv4 address;
    `exec(name)` the command prefix that runs a program inside it."""

    hosts: dict[str, str | None]
    """host name -> its link's rate limit for what it sends (tc syntax, e.g.
    "1gbit"), or None for an unlimited link."""
    address: dict[str, str] = field(default_factory=dict)
    prefix: str = PREFIX
    """Of every namespace's name; a test uses its own, so it never deletes a
    running benchmark's network."""

    def ns(self, host: str) -> str:
        return self.prefix + host

    def exec(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    def __enter__(self) -> Network:
        check_available()
        cleanup(self.prefix)
        try:
            self._create()
        except BaseException:
            cleanup(self.prefix)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        cleanup(self.prefix)

    def _create(self) -> None:
        hub = self.ns("hub")
        _ip("netns", "add", hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, (host, rate) in enumerate(self.hosts.items()):
            ns = self.ns(host)
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            port = f"v{i}"
            _ip("-n", hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", hub, "link", "set", port, "master", "br0", "up")
            address = f"{SUBNET}.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            if rate is not None:
                # A token bucket on the host's side caps what it sends; a
                # burst of a few ms at the rate keeps the average exact
                # without starving TCP (tbf needs burst >= rate / HZ).
                _tc(ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
                    "burst", "1mb", "latency", "20ms")  # fmt: skip
            self.address[host] = address
