"""Starting one rank's servers and clients for its Manager.

Apart from rank.py (the Manager's step machine) because it runs once, at construction, and touches
nothing of the training step: connect to the group's TCPStore, start the
checkpoint server, start the group's ManagerServer on rank 0 and publish its
address and the group's replica id in the store, connect every rank to it,
and serve the rank's metrics. The Manager keeps what this returns under the
names torchft's tests and our wrappers read (`_store`, `_manager_server`,
`_checkpoint_transport`, `_client`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

from lighthouse.rpc.address import join_host_port, loopback_advertisement_warning
from lighthouse.rpc.tls import TLSConfig
from lighthouse.web.metrics import MetricsServer
from torchft_like.checkpointing import CheckpointTransport, HTTPTransport
from torchft_like.manager.config import ManagerConfig
from torchft_like.manager.group.client import LocalManagerClient, ManagerClientProtocol
from torchft_like.manager.group.server import ManagerServer
from torchft_like.manager.metrics import ManagerMetrics
from torchft_like.process_group import ProcessGroupDummy

MANAGER_ADDR_KEY = "manager_addr"
REPLICA_ID_KEY = "replica_id"

ClientFactory = Callable[[str, timedelta, str | None, TLSConfig | None], ManagerClientProtocol]
"""Makes a ManagerClient from (address, connect timeout, secret, TLS)."""


@dataclass(frozen=True)
class RankServers:
    """What `start_rank_servers` started and connected."""

    store: TCPStore
    checkpoint_transport: CheckpointTransport
    manager_server: ManagerServer | None
    """The group's ManagerServer on group rank 0; None on the other ranks."""
    client: ManagerClientProtocol
    replica_id: str
    """The group's `{name}:{uuid}`, as rank 0 published it."""
    manager_address: str
    metrics_server: MetricsServer | None


def start_rank_servers(
    config: ManagerConfig,
    pg: Any,
    checkpoint_transport: CheckpointTransport | None,
    metrics: ManagerMetrics,
    make_client: ClientFactory,
    log: logging.LoggerAdapter[logging.Logger],
) -> RankServers:
    """Starts this rank's servers; `checkpoint_transport` None: an HTTPTransport.

    `make_client` is passed in by the caller (the Manager passes the
    package's `torchft_like.manager.ManagerClient`) so that tests patching
    that name still reach it.

    Raises:
        Exception: the store, a server or the lighthouse could not be reached
            or started (ManagerServer's and HTTPTransport's errors).
    """
    store = TCPStore(
        config.store_addr,
        config.store_port,
        is_master=False,
        wait_for_workers=False,
        timeout=config.connect_timeout,
    )
    listen_host = config.bind_host or config.hostname
    transport = checkpoint_transport or HTTPTransport(
        timeout=config.timeout,
        hostname=config.hostname,
        secret=config.secret,
        bind_host=config.bind_host,
        tls=config.tls,
    )
    manager_server: ManagerServer | None = None
    prefix = config.store_prefix
    if config.rank == 0:
        assert config.lighthouse_addr is not None  # resolve_config requires it on rank 0
        warning = loopback_advertisement_warning(config.hostname, config.lighthouse_addr)
        if warning:
            log.warning("%s", warning)
        full_id = f"{config.replica_id}:{uuid.uuid4()}"
        manager_server = ManagerServer(
            replica_id=full_id,
            lighthouse_addr=config.lighthouse_addr,
            hostname=config.hostname,
            bind=join_host_port(listen_host, config.port),
            store_addr=join_host_port(config.store_addr, config.store_port),
            world_size=config.world_size,
            heartbeat_interval=config.heartbeat_interval,
            connect_timeout=config.connect_timeout,
            quorum_retries=config.quorum_retries,
            secret=config.secret,
            tls=config.tls,
            local_collectives=isinstance(pg, ProcessGroupDummy),
            job_id=config.job_id,
            sched_batch=config.control_sched == "batch",
        )
        store.set(prefix + MANAGER_ADDR_KEY, manager_server.address())
        store.set(prefix + REPLICA_ID_KEY, full_id)
    manager_address = store.get(prefix + MANAGER_ADDR_KEY).decode()
    replica_id = store.get(prefix + REPLICA_ID_KEY).decode()
    client: ManagerClientProtocol = (
        LocalManagerClient(manager_server)
        if manager_server is not None
        else make_client(manager_address, config.connect_timeout, config.secret, config.tls)
    )
    # Last, so a failed start leaves no server behind.
    metrics_server = (
        metrics.serve(listen_host, config.metrics_port) if config.metrics_port is not None else None
    )
    return RankServers(
        store=store,
        checkpoint_transport=transport,
        manager_server=manager_server,
        client=client,
        replica_id=replica_id,
        manager_address=manager_address,
        metrics_server=metrics_server,
    )


def check_transport(
    transport: CheckpointTransport | None, secret: str | None, tls: TLSConfig | None
) -> None:
    """A given HTTPTransport must share the Manager's secret and TLS, or peers cannot fetch.

    Raises:
        ValueError: its secret or TLS configuration differs.
    """
    if not isinstance(transport, HTTPTransport):
        return
    if transport.secret != secret:
        raise ValueError(
            "checkpoint_transport's secret differs from the Manager's (TORCHFT_SECRET_FILE "
            "or TORCHFT_SECRET): pass HTTPTransport(..., secret=...) the same secret, or "
            "the peers cannot fetch from each other"
        )
    if transport.tls != tls:
        raise ValueError(
            "checkpoint_transport's TLS configuration differs from the Manager's "
            "(TORCHFT_TLS_*): pass HTTPTransport(..., tls=...) the same TLSConfig"
        )
