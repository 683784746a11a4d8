"""Prometheus metrics of one rank's Manager, and where they are served.

Every rank serves its own: timings and heals are per rank (each rank copies
its own part of the state), and a scraper that knows the job's hosts finds
each rank at a port derived from one variable, without asking rank 0.

Served only when TORCHFT_METRICS_PORT is set: N serves rank `LOCAL_RANK` at
N + LOCAL_RANK (torchrun's ranks on one host do not collide); 0 picks a
free port per rank and logs it. The server binds where the Manager's other
servers bind (TORCHFT_BIND_HOST, else the advertised host name). Like the
lighthouse's page, it is read-only and open: counts and timings, no state.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lighthouse.rpc.address import join_host_port
from lighthouse.web.metrics import MetricsServer

logger = logging.getLogger(__name__)

METRICS_PORT_ENV = "TORCHFT_METRICS_PORT"
_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def metrics_port_from_env(environ: Mapping[str, str]) -> int | None:
    """The port this rank serves its metrics on, or None (off).

    Raises:
        ValueError: the variable is not a port number.
    """
    value = environ.get(METRICS_PORT_ENV, "")
    if not value:
        return None
    try:
        base = int(value)
        local_rank = int(environ.get("LOCAL_RANK", "0"))
    except ValueError:
        raise ValueError(
            f"{METRICS_PORT_ENV}={value!r} is not a port number; set it to a free port N "
            "(local rank r serves on N + r), 0 for any free port, or leave it unset (off)"
        ) from None
    if not 0 <= base <= 65535:
        raise ValueError(f"{METRICS_PORT_ENV} ({base}) must be in [0, 65535]")
    return 0 if base == 0 else base + local_rank


class ManagerMetrics:
    """One rank's metrics, in a private registry (several Managers share a
    process in tests). Every series carries `replica_group` and `group_rank`."""

    def __init__(self, replica_group: str, group_rank: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        names = ("replica_group", "group_rank")
        values = (replica_group, str(group_rank))

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, names, registry=r, buckets=_SECONDS).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(*values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r).labels(*values)

        self.step_seconds = histogram(
            "torchft_manager_step_seconds", "Seconds from start_quorum to the end of should_commit"
        )
        self.quorum_seconds = histogram(
            "torchft_manager_quorum_seconds",
            "Seconds the step's quorum took (the group's ask and the lighthouse's answer)",
        )
        self.commit_failures = counter(
            "torchft_manager_commit_failures", "Steps that did not commit"
        )
        self.committed_steps = counter("torchft_manager_committed_steps", "Steps committed")
        self.heals = counter(
            "torchft_manager_heals", "Times this rank copied the state from a peer"
        )
        self.heal_bytes = counter(
            "torchft_manager_heal_bytes", "Tensor bytes received while healing"
        )
        self.heal_seconds = histogram(
            "torchft_manager_heal_seconds",
            "Seconds from the quorum's answer to the healing state received",
        )
        self.step = gauge("torchft_manager_step", "Committed steps of this replica group")
        self.quorum_id = gauge("torchft_manager_quorum_id", "Id of the current quorum")
        self.participants = gauge(
            "torchft_manager_participants",
            "Replica groups at the max step in the current quorum (they average gradients)",
        )

    def record_quorum(self, quorum_id: int, num_participants: int) -> None:
        self.quorum_id.set(quorum_id)
        self.participants.set(num_participants)

    def record_heal(self, num_bytes: int, seconds: float) -> None:
        self.heals.inc()
        self.heal_bytes.inc(num_bytes)
        self.heal_seconds.observe(seconds)

    def record_step(self, committed: bool, step: int, seconds: float) -> None:
        """One should_commit's outcome: `step` is the step after it, `seconds`
        the time since start_quorum."""
        self.step_seconds.observe(seconds)
        if committed:
            self.committed_steps.inc()
            self.step.set(step)
        else:
            self.commit_failures.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, host: str, port: int) -> MetricsServer:
        server = MetricsServer(join_host_port(host, port), self.render, "manager metrics")
        logger.info("manager metrics on %s", server.address())
        return server
