"""PGTransport over a real 3-rank gloo process group (ranks as threads)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from tests.integration.test_http_transport import assert_identical, rich_state
from torchft_like import ProcessGroupGloo
from torchft_like.checkpointing.pg_transport import PGTransport

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=10)


def run_ranks(body) -> list:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def rank_main(rank: int):
        pg = ProcessGroupGloo(timeout=T)
        pg.configure(f"127.0.0.1:{store.port}/t", "0", rank, 3)
        try:
            return body(rank, PGTransport(pg, timeout=T, device=torch.device("cpu")))
        except Exception as e:
            return e
        finally:
            pg.shutdown()

    with ThreadPoolExecutor(3) as pool:
        return list(pool.map(rank_main, range(3)))


def test_a_state_reaches_every_healing_rank_bit_identical():
    state = rich_state()

    def body(rank: int, transport: PGTransport) -> object:
        if rank == 0:
            transport.send_checkpoint([1, 2], 5, state, T)
            return None
        return transport.recv_checkpoint(0, transport.metadata(), 5, T)

    results = run_ranks(body)
    assert results[0] is None
    for got in results[1:]:
        assert_identical(state, got)


def test_a_wrong_step_is_refused_and_a_silent_source_times_out():
    def body(rank: int, transport: PGTransport) -> object:
        if rank == 0:
            transport.send_checkpoint([1], 6, {"step": 6}, T)  # header only
            return None
        if rank == 1:
            with pytest.raises(RuntimeError, match="the source is serving step 6, not 7"):
                transport.recv_checkpoint(0, "<n/a>", 7, T)
            return "refused"
        with pytest.raises(RuntimeError, match="recv of step 3 from replica rank 0 .*timed out"):
            transport.recv_checkpoint(0, "<n/a>", 3, timedelta(milliseconds=50))
        return "timed out"

    assert run_ranks(body) == [None, "refused", "timed out"]
