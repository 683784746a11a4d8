"""Starting the project's asyncio gRPC servers: auth, TLS, guarded decoding, the bound port.

Two server runtimes serve the same handlers: grpcio's (`"grpcio"`,
lighthouse.rpc.grpcio_server) and our own (`"lean"`, lighthouse.rpc.lean,
a fraction of grpcio's CPU per call). Both present one server shape here
and one call shape to the servicer (lighthouse.rpc.call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lighthouse.rpc import auth
from lighthouse.rpc.address import join_host_port
from lighthouse.rpc.decode_guard import add_servicer
from lighthouse.rpc.grpcio_server import GrpcioServer
from lighthouse.rpc.lean.server import LeanServer
from lighthouse.rpc.tls import TLSConfig

RUNTIMES: dict[str, Callable[..., Any]] = {
    "lean": LeanServer,
    "grpcio": GrpcioServer,
}
RPC_SERVERS = tuple(RUNTIMES)


def new_server(
    add_to_server: Callable[[Any, Any], None],
    servicer: Any,
    secret: str | auth.Secrets | None,
    service: str,
    rpc_server: str = "grpcio",
    stream_message_rate: tuple[float, float] | None = None,
) -> Any:
    """A server (`rpc_server`: one of RPC_SERVERS) serving `servicer`,
    refusing calls without the secret (one, or each job's: auth.Secrets;
    `service` names it in refusals) and
    undecodable requests, and (our runtime) streaming calls past
    `stream_message_rate` messages."""
    runtime = RUNTIMES.get(rpc_server)
    if runtime is None:
        raise ValueError(f"rpc_server must be one of {', '.join(RPC_SERVERS)}; got {rpc_server!r}")
    server = runtime(secret, service, stream_message_rate)
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
    bound: int = server.add_port(address, tls)
    if bound == 0:
        raise OSError(
            f"cannot listen on {address}: the port is in use or the address is not available; {fix}"
        )
    return bound
