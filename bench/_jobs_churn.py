"""Short-lived jobs on one lighthouse, for bench.lighthouse_jobs: does a
lighthouse that has seen many jobs come and go give their memory back?

A fresh lighthouse (ours, --job-idle-s `idle_s`, --max-jobs above the
count so none is refused, /metrics on) and `n` jobs, `concurrency` at a
time, each a client of its own (a new connection, its job in the
torchft-job metadata): one group calls Quorum (min_replicas 1, so it has a
quorum of itself at the next decision), then Leave, and closes. A job with
no member left is forgotten after --job-idle-s. Measured: the lighthouse's
RSS before, its peak, and once /metrics' torchft_lighthouse_jobs says only
the default job is left (and a settling second); that gauge before, at its
highest (polled each second: a scrape renders every job's series, which
at a thousand jobs costs the lighthouse enough to slow the churn), and at
the end.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from typing import Any

import psutil

from bench.lighthouse_scale import start_server
from lighthouse.client import LEAVE_METHOD, QUORUM_METHOD
from lighthouse.rpc.auth import metadata
from lighthouse.rpc.lean.client import CallFailed, LeanChannel, Unavailable
from lighthouse.rpc.proto import torchft_pb2 as pb
from lighthouse.shell.jobs import TRIM_EVERY_S
from tools.procs import PeakRss, free_port, kill_tree, wait_listening

CALL_S = 10.0
"""A short job's call that takes longer failed (counted, not fatal)."""
GAUGE = "torchft_lighthouse_jobs"
MB = 2**20


def jobs_gauge(http_port: int) -> int:
    """The job count on the lighthouse's /metrics."""
    url = f"http://127.0.0.1:{http_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith(GAUGE + " "):
                return int(float(line.split()[1]))
    raise RuntimeError(f"no {GAUGE} on {url}")


class GaugePeak:
    """The highest job count /metrics shows, polled in a thread until `stop`."""

    def __init__(self, http_port: int, interval_s: float = 1.0) -> None:
        self.http_port, self.interval_s, self.peak = http_port, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, jobs_gauge(self.http_port))
            except (OSError, RuntimeError):
                pass  # a slow scrape under load: the next one counts
            self._stop.wait(self.interval_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


async def short_job(target: str, i: int) -> str | None:
    """One job's life; None, or why it failed."""
    job, rid = f"short-{i}", f"short-{i}:0"
    channel = LeanChannel(target, metadata(None, job))
    member = pb.QuorumMember(
        replica_id=rid, address=f"http://s{i}:1", store_address=f"s{i}:2", step=0, world_size=1
    )
    try:
        asked = pb.LighthouseQuorumRequest(requester=member).SerializeToString()
        await channel.unary(QUORUM_METHOD, asked, CALL_S)
        leave = pb.LighthouseLeaveRequest(replica_id=rid).SerializeToString()
        await channel.unary(LEAVE_METHOD, leave, CALL_S)
        return None
    except (Unavailable, CallFailed) as e:
        return f"{job}: {e!r}"[:200]
    finally:
        channel.close()


async def all_jobs(target: str, n: int, concurrency: int) -> list[str]:
    """Runs the `n` jobs, `concurrency` at a time; the failures."""
    left = iter(range(n))
    failures: list[str] = []

    async def worker() -> None:
        for i in left:
            why = await short_job(target, i)
            if why is not None:
                failures.append(why)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return failures


def measure(n: int, concurrency: int, idle_s: float, deadline_s: float) -> dict[str, Any]:
    """The churn's figures (module docstring); everything started is gone on return."""
    port, http_port = free_port(), free_port()
    extra: tuple[str, ...] = (
        "--http-bind",
        f"127.0.0.1:{http_port}",
        "--job-idle-s",
        f"{idle_s:g}",
    )
    extra += ("--max-jobs", str(n + 1))  # none refused
    lighthouse = start_server("ours", 1, 1, port, extra)
    try:
        wait_listening(http_port, lighthouse, "the lighthouse's status page")
        lh = psutil.Process(lighthouse.pid)
        time.sleep(1.0)  # its start-up allocations done
        rss_before, gauge_before = lh.memory_info().rss, jobs_gauge(http_port)
        peak, gauge = PeakRss(lh, interval_s=0.1), GaugePeak(http_port)
        t0 = time.monotonic()
        failures = asyncio.run(
            asyncio.wait_for(all_jobs(f"127.0.0.1:{port}", n, concurrency), deadline_s)
        )
        ran_s = time.monotonic() - t0
        gauge_after = jobs_gauge(http_port)
        until = time.monotonic() + 3 * idle_s + 10  # the sweep runs each second
        while gauge_after > gauge_before and time.monotonic() < until:
            time.sleep(0.2)
            gauge_after = jobs_gauge(http_port)
        forgotten_s = time.monotonic() - t0 - ran_s
        time.sleep(TRIM_EVERY_S + 1.0)  # the last sweep's frees, and the heap's trim
        rss_after = lh.memory_info().rss
        gauge_peak, rss_peak = gauge.stop(), peak.stop()
    finally:
        kill_tree(lighthouse.pid)
        lighthouse.wait(10)
    return {
        "jobs": n,
        "concurrency": concurrency,
        "job_idle_s": idle_s,
        "seconds": round(ran_s, 1),
        "jobs_per_s": round(n / ran_s, 1),
        "failed": len(failures),
        "first_failure": failures[0] if failures else None,
        "rss_before_mb": round(rss_before / MB, 1),
        "rss_peak_mb": round(rss_peak / MB, 1),
        "rss_after_mb": round(rss_after / MB, 1),
        "jobs_gauge_before": gauge_before,
        "jobs_gauge_peak": gauge_peak,
        "jobs_gauge_after": gauge_after,
        "forgotten_after_s": round(forgotten_s, 1),
    }
