"""Cost of the shared secret per gRPC call: Heartbeat round trips, open vs secured.

    python -m bench.auth_overhead [--calls 500] [--rounds 7]

Two lighthouses in this process, one without and one with a secret. Each
round times `--calls` Heartbeat calls from a blocking client (what ranks use
towards a ManagerServer) and from an asyncio client (what a ManagerServer
uses towards the lighthouse), alternating open and secured (A B A B) so that
load from other work hits both alike. Figures: median, min and max over the
rounds of the mean time per call.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from datetime import timedelta

from bench._report import add_common_args, report, results_file
from lighthouse import LighthouseServer
from lighthouse.client import AsyncLighthouseClient, LighthouseClient

SECRET = "bench-secret-0123456789abcdef"
T = timedelta(seconds=10)


def sync_round(client: LighthouseClient, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        client.heartbeat("bench", T)
    return (time.perf_counter() - start) / calls


async def aio_round(client: AsyncLighthouseClient, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        await client.heartbeat("bench", T)
    return (time.perf_counter() - start) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--rounds", type=int, default=7)
    add_common_args(p)
    args = p.parse_args()
    if args.smoke:
        args.calls, args.rounds = 20, 1
    servers = {
        "open": LighthouseServer(bind="127.0.0.1:0", min_replicas=1),
        "secret": LighthouseServer(bind="127.0.0.1:0", min_replicas=1, secret=SECRET),
    }
    secrets = {"open": None, "secret": SECRET}
    loop = asyncio.new_event_loop()
    sync_clients = {k: LighthouseClient(s.address(), T, secrets[k]) for k, s in servers.items()}

    async def make_aio_clients() -> dict[str, AsyncLighthouseClient]:  # on the loop they use
        return {k: AsyncLighthouseClient(s.address(), T, secrets[k]) for k, s in servers.items()}

    aio_clients = loop.run_until_complete(make_aio_clients())
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for kind in servers:  # warm-up: connect, first-call costs
            sync_round(sync_clients[kind], 20)
            loop.run_until_complete(aio_round(aio_clients[kind], 20))
        for _ in range(args.rounds):
            for kind in servers:
                times.setdefault(("blocking", kind), []).append(
                    sync_round(sync_clients[kind], args.calls)
                )
                times.setdefault(("asyncio", kind), []).append(
                    loop.run_until_complete(aio_round(aio_clients[kind], args.calls))
                )
    finally:
        for client in sync_clients.values():
            client.close()
        for client in aio_clients.values():
            loop.run_until_complete(client.close())
        loop.close()
        for server in servers.values():
            server.shutdown()
    rows = []
    for client_kind in ("blocking", "asyncio"):
        open_median = statistics.median(times[(client_kind, "open")])
        for kind in servers:
            samples = [t * 1e6 for t in times[(client_kind, kind)]]
            rows.append(
                {
                    "bench": "auth_overhead",
                    "client": client_kind,
                    "server": kind,
                    "calls": args.calls,
                    "rounds": args.rounds,
                    "median_us": round(statistics.median(samples), 1),
                    "min_us": round(min(samples), 1),
                    "max_us": round(max(samples), 1),
                    "ratio_to_open": round(statistics.median(samples) / open_median / 1e6, 3),
                }
            )
    report(rows, results_file(args.out, "auth_overhead"))


if __name__ == "__main__":
    main()
