"""Parsing of bind addresses and service URLs, with errors that say the fix."""

from __future__ import annotations

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


def url_to_target(url: str) -> str:
    """`http://host:port` (or bare `host:port`) to a gRPC target `host:port`."""
    target = url.split("://", 1)[1] if "://" in url else url
    target = target.rstrip("/")
    parse_bind(target)  # validates
    return target
