"""Starting the project's asyncio gRPC servers: auth, TLS, guarded decoding, the bound port.

Two server runtimes serve the same handlers: grpcio's (`"grpcio"`) and
lighthouse.rpc.lean.server (`"lean"`, a fraction of grpcio's CPU per call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpc import aio

from lighthouse.rpc import auth
from lighthouse.rpc.address import join_host_port
from lighthouse.rpc.decode_guard import add_servicer
from lighthouse.rpc.lean.server import LeanServer
from lighthouse.rpc.tls import TLSConfig

SERVER_OPTIONS = [
    # Off: a second server on a port in use must fail, not share it.
    ("grpc.so_reuseport", 0),
    # A connection that has not finished its HTTP/2 handshake in 10 s (a port
    # scan, a stray HTTP/1 client) is dropped, not held for gRPC's default 120 s.
    ("grpc.server_handshake_timeout_ms", 10_000),
    # A connection with no call for 5 minutes is closed; our clients keep a
    # call open (the heartbeat stream) or reconnect on their next call.
    ("grpc.max_connection_idle_ms", 300_000),
]


RPC_SERVERS = ("lean", "grpcio")


def new_server(
    add_to_server: Callable[[Any, Any], None],
    servicer: Any,
    secret: str | None,
    service: str,
    rpc_server: str = "grpcio",
) -> Any:
    """A server (`rpc_server`: one of RPC_SERVERS) serving `servicer`,
    refusing calls without the secret (`service` names it in refusals) and
    undecodable requests."""
    server: Any
    if rpc_server == "lean":
        server = LeanServer(secret, service)
    elif rpc_server == "grpcio":
        server = aio.server(
            options=SERVER_OPTIONS,
            interceptors=auth.server_interceptors(secret, service),
        )
    else:
        raise ValueError(f"rpc_server must be one of {', '.join(RPC_SERVERS)}; got {rpc_server!r}")
    add_servicer(add_to_server, servicer, server)
    return server


def bind(server: Any, host: str, port: int, fix: str, tls: TLSConfig | None = None) -> int:
    """Adds the listening port, TLS with `tls`, plaintext without; returns
    the port bound (port 0 picks one).

    Raises:
        OSError: the port is in use or the address not available; the text
            ends with `fix`, which names the flag or variable to change.
    """
    address = join_host_port(host, port)
    credentials: Any = None
    if tls is not None and isinstance(server, LeanServer):
        credentials = tls.server_context()
        credentials.set_alpn_protocols(["h2"])
    elif tls is not None:
        credentials = tls.server_credentials()
    bound: int
    try:
        if credentials is not None:
            bound = server.add_secure_port(address, credentials)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(
            f"cannot listen on {address}: the port is in use or the address is not available; {fix}"
        )
    return bound
