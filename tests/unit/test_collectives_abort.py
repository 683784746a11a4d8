"""InOrderCollectives.abort: a step's allreduces end at once when a member of
its quorum is gone (torchft_like.manager.gone_watch), and an abandoned collective
never writes into the caller's tensor. A fake process group whose
collectives the test completes by hand; no sockets, no clock."""

from __future__ import annotations

from typing import Any

import torch

from torchft_like._work import FutureWork
from torchft_like.collectives import InOrderCollectives


class HandPG:
    """Each allreduce waits until the test completes it."""

    def __init__(self) -> None:
        self.issued: list[tuple[torch.Tensor, torch.futures.Future[Any]]] = []

    def allreduce(self, tensors: list[torch.Tensor], op: Any) -> FutureWork:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        self.issued.append((tensors[0], fut))
        return FutureWork(fut)

    def complete(self, index: int, value: float) -> None:
        tensor, fut = self.issued[index]
        tensor.fill_(value)  # what gloo writes: the sum, into the tensor it was given
        fut.set_result([tensor])


def test_a_completed_allreduce_writes_the_sum_divided_into_the_callers_tensor():
    pg, colls, errors = HandPG(), InOrderCollectives(), []
    t = torch.ones(4)
    work = colls.allreduce(t, pg, False, 2, errors.append)
    assert pg.issued[0][0] is not t, "gloo reduces a private copy"
    assert torch.equal(pg.issued[0][0], t)
    pg.complete(0, 6.0)
    assert work.get_future().wait() is t
    assert torch.equal(t, torch.full((4,), 3.0)) and errors == []


def test_abort_settles_every_allreduce_in_flight_and_fails_later_ones_until_reset():
    pg, colls, errors = HandPG(), InOrderCollectives(), []
    t1, t2 = torch.ones(3), torch.ones(5)
    w1 = colls.allreduce(t1, pg, False, None, errors.append)
    w2 = colls.allreduce(t2, pg, False, None, errors.append)
    gone = RuntimeError("quorum 7: c gone")
    assert colls.abort(gone) == 2
    assert w1.get_future().done() and w2.get_future().done(), "the training thread waits no more"
    assert errors == [gone, gone]
    w3 = colls.allreduce(torch.ones(1), pg, False, None, errors.append)
    assert w3.get_future().done() and errors == [gone] * 3 and len(pg.issued) == 2
    colls.reset()
    colls.allreduce(torch.ones(1), pg, False, None, errors.append)
    assert len(pg.issued) == 3 and errors == [gone] * 3


def test_an_abandoned_collective_that_completes_later_changes_nothing():
    pg, colls, errors = HandPG(), InOrderCollectives(), []
    t = torch.ones(4)
    colls.allreduce(t, pg, False, 2, errors.append)
    colls.abort(RuntimeError("gone"))
    colls.reset()
    t.fill_(7.0)  # the next step's gradients, in the same bucket
    pg.complete(0, 100.0)  # the gone member came back: the old collective completes
    assert torch.equal(t, torch.full((4,), 7.0)) and len(errors) == 1
    # ...and its private copy is never handed to a later allreduce.
    colls.allreduce(t, pg, False, None, errors.append)
    assert pg.issued[1][0] is not pg.issued[0][0]


def test_abort_with_nothing_in_flight_fails_nothing():
    pg, colls, errors = HandPG(), InOrderCollectives(), []
    t = torch.ones(2)
    colls.allreduce(t, pg, False, None, errors.append)
    pg.complete(0, 2.0)
    assert colls.abort(RuntimeError("gone")) == 0
    assert errors == [] and torch.equal(t, torch.full((2,), 2.0))


def test_private_copies_are_reused_across_steps():
    pg, colls, errors = HandPG(), InOrderCollectives(), []
    t = torch.ones(4)
    colls.allreduce(t, pg, False, None, errors.append)
    pg.complete(0, 1.0)
    colls.allreduce(t, pg, False, None, errors.append)
    assert pg.issued[1][0] is pg.issued[0][0]


def test_in_place_the_caller_tensor_is_reduced_and_an_abort_counts_it_abandoned():
    pg, colls, errors = HandPG(), InOrderCollectives(), []
    t, u = torch.ones(4), torch.ones(2)
    work = colls.allreduce(t, pg, False, 2, errors.append, in_place=True)
    assert pg.issued[0][0] is t, "no private copy"
    assert torch.equal(t, torch.full((4,), 0.5)), "divided before the sum, as torch DDP does"
    pg.complete(0, 3.0)  # the sum of both replicas' halves
    assert work.get_future().wait() is t and torch.equal(t, torch.full((4,), 3.0))
    colls.allreduce(u, pg, False, None, errors.append, in_place=True)
    colls.allreduce(torch.ones(1), pg, False, None, errors.append)  # a private copy
    assert colls.abandoned == 0
    assert colls.abort(RuntimeError("gone")) == 2
    assert colls.abandoned == 1, "only the in-place tensor is left to the abandoned collective"
