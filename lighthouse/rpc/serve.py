"""Starting the project's asyncio gRPC servers: auth, guarded decoding, a port or an explanation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpc import aio

from lighthouse.rpc import auth
from lighthouse.rpc.address import join_host_port
from lighthouse.rpc.decode_guard import add_servicer


def new_server(
    add_to_server: Callable[[Any, Any], None], servicer: Any, secret: str | None, service: str
) -> aio.Server:
    """An aio server serving `servicer`, refusing calls without the secret
    (`service` names it in refusals) and undecodable requests."""
    # so_reuseport off: a second server on a port in use must fail, not share it.
    server = aio.server(
        options=[("grpc.so_reuseport", 0)],
        interceptors=auth.server_interceptors(secret, service),
    )
    add_servicer(add_to_server, servicer, server)
    return server


def bind(server: aio.Server, host: str, port: int, fix: str) -> int:
    """Adds the listening port; returns the port bound (port 0 picks one).

    Raises:
        OSError: the port is in use or the address not available; the text
            ends with `fix`, which names the flag or variable to change.
    """
    address = join_host_port(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(
            f"cannot listen on {address}: the port is in use or the address is not available; {fix}"
        )
    return bound
