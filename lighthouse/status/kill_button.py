"""The status page's kill button: Kill sent to a replica's ManagerServer, with the job's secret."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable

import grpc

from lighthouse.core.quorum import QuorumMember
from lighthouse.rpc import auth, channel
from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.rpc.proto import torchft_pb2_grpc as pb_grpc
from lighthouse.rpc.tls import TLSConfig

logger = logging.getLogger(__name__)

KILL_TIMEOUT_S = 5.0


def kill(
    replica_id: str,
    typed_secret: str,
    peer: str,
    secret: str | None,
    enabled: bool,
    lookup: Callable[[], QuorumMember | None],
    tls: TLSConfig | None,
) -> tuple[int, str]:
    """Sends Kill to `replica_id`'s ManagerServer (found by `lookup`), with
    the job's secret, if `typed_secret` is that secret.

    Refused (403) when the button is off (`enabled`), when the job has no
    secret (the ManagerServer would refuse a Kill without one too: with no
    secret nothing tells who asks) and when the typed secret is wrong
    (compared in constant time). Returns (HTTP status, message for the operator).
    """
    if secret is None:
        return 403, (
            "kill refused: this job has no shared secret, so nothing can tell who asks "
            "(the ManagerServers refuse Kill without one too); start the lighthouse and "
            f"every replica group with {auth.SECRET_FILE_ENV} set to a file holding the "
            "secret, and the lighthouse with --kill-button"
        )
    if not enabled:
        return 403, (
            "kill refused: the kill button is off; start the lighthouse with --kill-button"
        )
    if not hmac.compare_digest(typed_secret.encode(), secret.encode()):
        logger.warning("status page: kill of %s refused to %s: wrong secret", replica_id, peer)
        return 403, "kill refused: that is not the job's secret"
    member = lookup()
    if member is None or not member.address:
        return 404, f"kill refused: no replica {replica_id!r} with a known address"
    target = member.address.split("://", 1)[-1]
    logger.warning("status page: %s asked to kill %s (%s)", peer, replica_id, target)
    ch = channel.blocking_channel(target, secret, tls)
    try:
        stub = pb_grpc.ManagerServiceStub(ch)
        stub.Kill(
            pb.KillRequest(msg=f"killed from the lighthouse status page by {peer}"),
            timeout=KILL_TIMEOUT_S,
        )
    except Exception as e:
        why = e.details() if isinstance(e, grpc.RpcError) else str(e)
        return 502, f"kill of {replica_id} at {member.address} failed: {why}"
    finally:
        ch.close()
    return 200, f"Kill sent to {replica_id} at {member.address}"
