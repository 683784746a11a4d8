"""Parsing of bind addresses and service URLs, with errors that say the fix."""

from __future__ import annotations

import ipaddress
import socket

_WILDCARDS = ("", "::", "0.0.0.0", "[::]")


def parse_bind(bind: str) -> tuple[str, int]:
    """Splits `host:port` or `[v6]:port` into (host without brackets, port)."""
    host, sep, port_text = bind.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(
            f"bind address {bind!r} is not host:port; use e.g. [::]:29510 or 127.0.0.1:0"
        )
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"bind address {bind!r}: put an IPv6 host in brackets, e.g. [::1]:29510")
    return host, int(port_text)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised_host(bind_host: str) -> str:
    """The host name peers should use: the machine's name for a wildcard bind."""
    return socket.gethostname() if bind_host in _WILDCARDS else bind_host


BIND_HOST_ENV = "TORCHFT_BIND_HOST"
"""Host the library's servers (ManagerServer, checkpoint server) listen on
when set, e.g. 0.0.0.0 or :: for all interfaces; by default they listen on
the address they advertise to peers."""


HOSTNAME_ENV = "TORCHFT_HOSTNAME"
"""How peers on other machines reach this one (a name or an address, IPv6
without brackets), when the machine's name is not it: what the Manager's
servers advertise when no `hostname` argument is given."""


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) resolves only to loopback addresses.

    A wildcard ("", 0.0.0.0, ::) is every interface: not loopback. A name
    that does not resolve counts as not loopback (the safe answer for a
    warning about exposure).
    """
    if host in _WILDCARDS:
        return False
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addresses = {str(info[4][0]) for info in infos}
    return bool(addresses) and all(
        ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addresses
    )


def loopback_advertisement_warning(hostname: str, lighthouse_url: str) -> str | None:
    """A warning when this machine advertises a loopback-only name to a job
    that spans machines (its lighthouse is not on loopback), else None.

    The usual cause: /etc/hosts maps the machine's name to 127.0.1.1
    (Debian's default), so peers on other machines would be told to reach
    this group at their own loopback, and quorums or healing would fail.
    """
    lighthouse_host = url_to_target(lighthouse_url).rpartition(":")[0]
    if not is_loopback(hostname) or is_loopback(lighthouse_host):
        return None
    return (
        f"this replica group advertises {hostname!r}, which resolves only to loopback, "
        f"but the lighthouse ({lighthouse_url}) is not on loopback: groups on other "
        f"machines cannot reach this one. Set {HOSTNAME_ENV} to this machine's address "
        "as the others see it (e.g. its IP), or fix the name in /etc/hosts"
    )


def url_to_target(url: str, what: str = "address", fix: str = "") -> str:
    """`http://host:port` (or bare `host:port`) to a gRPC target `host:port`.

    Raises:
        ValueError: no port or a malformed one; the text names `what` (e.g.
            "lighthouse address (TORCHFT_LIGHTHOUSE)") and ends with `fix`, if given.
    """
    target = url.split("://", 1)[1] if "://" in url else url
    target = target.rstrip("/")
    host, sep, port_text = target.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535 or not host:
        fix = fix or "use http://host:port, e.g. http://localhost:29510"
        raise ValueError(f"{what} {url!r} has no valid port (host:port needed); {fix}")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"{what} {url!r}: put an IPv6 host in brackets, e.g. http://[::1]:29510")
    return target
