"""Prometheus metrics of one lighthouse, in a registry of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from lighthouse.core.quorum import Quorum


class LighthouseMetrics:
    """A private registry, so several lighthouses can live in one process
    (tests). Every series of a job carries its `job` label (`for_job`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        job = ["job"]
        self.quorums_issued = Counter(
            "torchft_lighthouse_quorums_issued", "Quorums issued", job, registry=r
        )
        self.quorum_id = Gauge(
            "torchft_lighthouse_quorum_id", "Id of the current quorum", job, registry=r
        )
        self.quorum_size = Gauge(
            "torchft_lighthouse_quorum_size", "Members in the current quorum", job, registry=r
        )
        self.healthy_replicas = Gauge(
            "torchft_lighthouse_healthy_replicas",
            "Replicas with a recent heartbeat",
            job,
            registry=r,
        )
        self.heartbeats = Counter(
            "torchft_lighthouse_heartbeats", "Heartbeats received", job, registry=r
        )
        self.goodput = Gauge(
            "torchft_lighthouse_goodput",
            "Committed replica-steps / possible ones since this lighthouse started "
            "(see the status page); NaN before the first step",
            job,
            registry=r,
        )
        self.spares_waiting = Gauge(
            "torchft_lighthouse_spares_waiting", "Hot spares waiting for a group", job, registry=r
        )
        self.spare_promotions = Counter(
            "torchft_lighthouse_spare_promotions",
            "Spares handed the name of a group that died",
            job,
            registry=r,
        )
        self.heartbeat_advice = Gauge(
            "torchft_lighthouse_heartbeat_advice_seconds",
            "Heartbeat period advised on HeartbeatPaced streams (lighthouse.core.pacing)",
            job,
            registry=r,
        )
        self.quorum_latency = Histogram(
            "torchft_lighthouse_quorum_call_seconds",
            "Time a Quorum call waited for its quorum",
            job,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.jobs = Gauge("torchft_lighthouse_jobs", "Jobs the lighthouse holds", registry=r)
        self._calmed = _Calmed()
        r.register(self._calmed)

    def for_job(self, job: str) -> JobMetrics:
        """The series of `job`, made now (a job's first call)."""
        return JobMetrics(self, job)

    def forget(self, job: str) -> None:
        """Drops `job`'s series (a job forgotten: its memory comes back)."""
        for family in _FAMILIES:
            metric = getattr(self, family)
            try:
                metric.remove(job)
            except KeyError:
                pass

    def watch_calmed(self, calmed: Callable[[], dict[str, int]]) -> None:
        """Exports the gRPC server's count of connections closed for a flood
        (GOAWAY ENHANCE_YOUR_CALM), by kind, read at each scrape."""
        self._calmed.source = calmed

    def render(self) -> bytes:
        return generate_latest(self.registry)


_FAMILIES = (
    "quorums_issued",
    "quorum_id",
    "quorum_size",
    "healthy_replicas",
    "heartbeats",
    "goodput",
    "spares_waiting",
    "spare_promotions",
    "heartbeat_advice",
    "quorum_latency",
)


class JobMetrics:
    """One job's series (LighthouseMetrics' families at its label), under
    the families' own names."""

    def __init__(self, metrics: LighthouseMetrics, job: str) -> None:
        for family in _FAMILIES:
            setattr(self, family, getattr(metrics, family).labels(job))
        self.goodput.set(float("nan"))

    def on_quorum(self, quorum: Quorum) -> None:
        self.quorums_issued.inc()
        self.quorum_id.set(quorum.quorum_id)
        self.quorum_size.set(len(quorum.participants))

    quorums_issued: Any
    quorum_id: Any
    quorum_size: Any
    healthy_replicas: Any
    heartbeats: Any
    goodput: Any
    spares_waiting: Any
    spare_promotions: Any
    heartbeat_advice: Any
    quorum_latency: Any


class _Calmed:
    """A collector over the server's own counts, which it keeps on its loop."""

    def __init__(self) -> None:
        self.source: Callable[[], dict[str, int]] = dict

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "torchft_lighthouse_http2_calmed",
            "gRPC connections closed with GOAWAY ENHANCE_YOUR_CALM for a flood, by kind "
            "(priority, empty_data, window_update, reset, ping, settings, ...)",
            labels=["kind"],
        )
        for kind, count in sorted(self.source().items()):
            family.add_metric([kind], count)
        yield family
