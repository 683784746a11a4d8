"""The int8 sum over real gloo groups (replicas as threads): close to the exact
sum, the same bytes on every replica, and in order when several are in flight
together with plain collectives."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
from torch.distributed import ReduceOp, TCPStore

from torchft_like.collectives import InOrderCollectives, allreduce_quantized
from torchft_like.process_group import ProcessGroupGloo

pytestmark = pytest.mark.timeout(60)


def tensors_of(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [
        torch.randn(n, generator=g) * scale for n, scale in ((5, 1.0), (1000, 3.0), (777, 1e-3))
    ]


@pytest.mark.parametrize("world", [2, 3])
def test_in_flight_quantized_and_plain_sums_match_and_agree(world):
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def replica(rank: int) -> list[torch.Tensor]:
        pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
        pg.configure(f"127.0.0.1:{store.port}/q/{world}", f"r{rank}", rank, world)
        issuer = InOrderCollectives()
        try:
            ts = tensors_of(rank)
            plain = torch.full((3,), float(rank + 1))
            # quantized, plain, quantized, quantized: all in flight at once
            works = [issuer.issue(lambda: allreduce_quantized(ts[0], pg), two_rounds=True)]
            works.append(issuer.issue(lambda: pg.allreduce([plain], ReduceOp.SUM), False))
            works += [
                issuer.issue(lambda t=t: allreduce_quantized(t, pg), two_rounds=True)
                for t in ts[1:]
            ]
            for w in works:
                w.wait()
            return [*ts, plain]
        finally:
            issuer.shutdown()
            pg.shutdown()

    with ThreadPoolExecutor(world) as pool:
        results = list(pool.map(replica, range(world)))
    exact = [sum(tensors_of(r)[i] for r in range(world)) for i in range(3)]
    for got in results:
        assert torch.equal(got[3], torch.full((3,), float(sum(range(1, world + 1)))))
        for i, want in enumerate(exact):
            assert torch.equal(got[i], results[0][i])  # every replica decodes the same bytes
            # each replica's rounding (half its block scale, absmax / 254), then the
            # rounding of the sum (at most world x absmax / 254)
            absmax = max(t[i].abs().max() for t in map(tensors_of, range(world)))
            bound = 1.001 * world * absmax / 127
            torch.testing.assert_close(got[i], want, rtol=0, atol=float(bound))
