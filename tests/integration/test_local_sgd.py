"""LocalSGD and (streaming) DiLoCo on real Managers, a real lighthouse and real
gloo, replica groups as threads: checked against a plain reference of the
algorithm, through a failed commit, and through a group that joins late."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore

from lighthouse import LighthouseServer
from tests.integration._replica import small_replica
from torchft_like import ProcessGroupGloo
from torchft_like.local_sgd import DiLoCo, LocalSGD
from torchft_like.process_group import FakeProcessGroupWrapper

pytestmark = pytest.mark.timeout(90)
TIMEOUT = timedelta(seconds=10)
INNER_LR, OUTER_LR, OUTER_MOMENTUM = 0.02, 0.7, 0.9


def make_model() -> nn.Sequential:
    """Every group starts from the same weights (init_sync is off). Not from
    torch.manual_seed: the groups are threads sharing the global generator."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.rand(p.shape, generator=g) - 0.5)
    return model


def batch(group: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * group + step)
    x = torch.randn(16, 4, generator=g)
    return x, torch.stack([x[:, 0] * x[:, 1], x[:, 2] - x[:, 3]], dim=1)


def inner_step(model: nn.Module, inner: torch.optim.Optimizer, group: int, step: int) -> None:
    inner.zero_grad()
    x, y = batch(group, step)
    nn.functional.mse_loss(model(x), y).backward()
    inner.step()


def fragments_of(model: nn.Sequential, num_fragments: int) -> list[nn.Module]:
    return [model] if num_fragments == 1 else [model[0], model[2]]


def outer_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)


@dataclass(kw_only=True)
class Config:
    algo: str = "diloco"
    sync_every: int = 4
    num_fragments: int = 1
    delay: int = 0
    alpha: float = 0.0
    quantize: bool = False
    bucketize: bool = False
    syncs: int = 3
    """Committed syncs to train for (Manager steps)."""


@dataclass
class Run:
    params: list[torch.Tensor]
    backup: list[dict[str, torch.Tensor]] = field(default_factory=list)
    outer: list[dict[str, Any]] = field(default_factory=list)
    step: int = 0
    syncs: list[dict[str, Any]] = field(default_factory=list)
    """After each sync: the Manager's step, the parameters and the backup."""


# ---- the reference: N replicas in plain torch, no Manager -------------------------


def reference(cfg: Config, num_groups: int) -> list[list[torch.Tensor]]:
    """Each group's final parameters (they differ where the last sync did
    not set them: other fragments, or alpha > 0)."""
    models = [make_model() for _ in range(num_groups)]
    inners = [torch.optim.AdamW(m.parameters(), lr=INNER_LR) for m in models]
    per_sync = cfg.sync_every // cfg.num_fragments
    glob = [
        [nn.Parameter(p.detach().clone()) for p in f.parameters()]
        for f in fragments_of(make_model(), cfg.num_fragments)
    ]
    outers = [outer_optimizer(ps) for ps in glob]
    committed = 0
    pending: list[torch.Tensor] = []
    for step in range(cfg.syncs * per_sync):
        for g in range(num_groups):
            inner_step(models[g], inners[g], g, step)
        local_step = step % per_sync + 1
        if cfg.algo == "localsgd":
            if local_step == per_sync:
                for ps in zip(*(m.parameters() for m in models)):
                    avg = sum(p.detach() for p in ps) / num_groups
                    for p in ps:
                        p.data.copy_(avg)
                committed += 1
            continue
        frag = committed % cfg.num_fragments
        frags = [list(fragments_of(m, cfg.num_fragments)[frag].parameters()) for m in models]
        if local_step == per_sync - cfg.delay:  # pseudo-gradients leave now
            pending = [
                sum(gp.detach() - fs[i].detach() for fs in frags) / num_groups
                for i, gp in enumerate(glob[frag])
            ]
        if local_step == per_sync:  # and are applied now
            for gp, pg in zip(glob[frag], pending):
                gp.grad = pg
            outers[frag].step()
            outers[frag].zero_grad()
            for fs in frags:
                for gp, p in zip(glob[frag], fs):
                    local = p.detach().clone()
                    p.data.copy_(gp.detach())
                    p.data.lerp_(local, cfg.alpha)
            committed += 1
    return [[p.detach().clone() for p in m.parameters()] for m in models]


# ---- our implementation: one replica group per thread ----------------------------


def run_group(
    lighthouse_addr: str,
    group: int,
    cfg: Config,
    fail_sync: int | None = None,
    started: threading.Event | None = None,
    reached: tuple[int, threading.Event] | None = None,
    step_sleep: float = 0.0,
    min_replica_size: int = 2,
) -> Run:
    """Trains until the Manager has committed `cfg.syncs` syncs. `fail_sync`:
    the collectives of our attempt at that Manager step fail (once)."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    if started is not None:
        assert started.wait(30)
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    pg = FakeProcessGroupWrapper(ProcessGroupGloo(timeout=TIMEOUT))
    manager = small_replica(
        group, 0, 1, store, lighthouse_addr, model, inner, pg=pg,
        use_async_quorum=False, init_sync=False, min_replica_size=min_replica_size,
    )  # fmt: skip
    frags = fragments_of(model, cfg.num_fragments)
    algo: LocalSGD | DiLoCo
    if cfg.algo == "localsgd":
        algo = LocalSGD(manager, model, inner, cfg.sync_every)
    else:
        algo = DiLoCo(
            manager, frags, inner, [outer_optimizer(f.parameters()) for f in frags],
            sync_every=cfg.sync_every, should_quantize=cfg.quantize,
            use_bucketization=cfg.bucketize,
            fragment_sync_delay=cfg.delay, fragment_update_alpha=cfg.alpha,
        )  # fmt: skip
    run = Run(params=[])
    step = 0
    try:
        with algo:
            while manager.current_step() < cfg.syncs:
                before = manager.current_step()
                if fail_sync == before and algo._local_step == 0:
                    pg.report_future_error(RuntimeError("injected: this sync fails"))
                    fail_sync = None
                inner_step(model, inner, group, step)
                step += 1
                if algo._local_step == 0:  # a sync just ran
                    run.syncs.append(snapshot(manager, model, algo))
                if reached is not None and manager.current_step() >= reached[0]:
                    reached[1].set()
                time.sleep(step_sleep)
        run.params = [p.detach().clone() for p in model.parameters()]
        run.step = manager.current_step()
        state = manager.full_state_dict()["user"]
        for i in range(len(frags) if cfg.algo == "diloco" else 0):
            fragment = state[f"StreamingDiLoCoFragment_{i}"]
            run.backup.append(fragment["original_parameters"])
            run.outer.append(fragment["outer_optimizer"])
        return run
    finally:
        manager.shutdown()


def snapshot(manager: Any, model: nn.Module, algo: Any) -> dict[str, Any]:
    backups = [
        {k: v.clone() for k, v in f.original_parameters.items()}
        for f in getattr(algo, "_fragments", [])
    ]
    return {
        "step": manager.current_step(),
        "params": [p.detach().clone() for p in model.parameters()],
        "backup": backups,
    }


def run_groups(cfg: Config, num_groups: int = 2, **kwargs: Any) -> list[Run]:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=num_groups)
    try:
        with ThreadPoolExecutor(num_groups) as pool:
            futures = [
                pool.submit(run_group, lighthouse.address(), g, cfg, **kwargs)
                for g in range(num_groups)
            ]
            return [f.result(timeout=80) for f in futures]
    finally:
        lighthouse.shutdown()


def assert_same_outer_state(a: Run, b: Run) -> None:
    assert a.step == b.step
    for fa, fb in zip(a.backup, b.backup, strict=True):
        for name in fa:
            assert torch.equal(fa[name], fb[name]), name
    for oa, ob in zip(a.outer, b.outer, strict=True):
        for sa, sb in zip(oa["state"].values(), ob["state"].values(), strict=True):
            assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])


# ---- tests -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        Config(algo="localsgd", sync_every=2, syncs=3),
        Config(sync_every=3, syncs=3),
        Config(sync_every=4, num_fragments=2, delay=1, alpha=0.5, syncs=4),
    ],
    ids=["localsgd", "diloco", "streaming-delay1-alpha0.5"],
)
def test_groups_match_a_plain_reference_of_the_algorithm(cfg):
    runs = run_groups(cfg)
    expected = reference(cfg, num_groups=2)
    for run, group_expected in zip(runs, expected, strict=True):
        assert run.step == cfg.syncs
        for got, want in zip(run.params, group_expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    if cfg.algo == "diloco":
        assert_same_outer_state(*runs)


def test_quantized_diloco_stays_identical_across_groups_and_close_to_exact():
    cfg = Config(sync_every=3, syncs=3, quantize=True)
    a, b = run_groups(cfg)
    expected = reference(cfg, num_groups=2)[0]
    for pa, pb, want in zip(a.params, b.params, expected, strict=True):
        assert torch.equal(pa, pb)  # every group decodes the same bytes
        torch.testing.assert_close(pa, want, rtol=0, atol=2e-2)
    assert max((pa - w).abs().max().item() for pa, w in zip(a.params, expected)) > 0
    assert_same_outer_state(a, b)


def test_a_sync_that_fails_to_commit_is_applied_nowhere_and_the_group_heals_after():
    # One bucket: the sync is one collective, which runs on both groups
    # and fails only in group 0 (a failed collective would otherwise make
    # group 0 skip the rest, and group 1 time out waiting for them).
    cfg = Config(sync_every=3, syncs=4, bucketize=True)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            failing = pool.submit(run_group, lighthouse.address(), 0, cfg, fail_sync=1)
            healthy = pool.submit(run_group, lighthouse.address(), 1, cfg)
            a, b = failing.result(timeout=80), healthy.result(timeout=80)
    finally:
        lighthouse.shutdown()
    # Group 0's second sync failed: its step stayed at 1, and the parameters
    # are the backup of the first sync, the same as after it.
    first, failed = a.syncs[0], a.syncs[1]
    assert (first["step"], failed["step"]) == (1, 1)
    for name, t in failed["backup"][0].items():
        assert torch.equal(t, first["backup"][0][name])
    for p, name in zip(failed["params"], failed["backup"][0]):
        assert torch.equal(p, failed["backup"][0][name])
    # Group 1 committed that sync; group 0 was a step behind at the next one,
    # healed the outer state from group 1 (and, the quorum being synchronous,
    # counted with group 1's copy, as torchft does), and both ended identical.
    assert [s["step"] for s in a.syncs] == [1, 1, 3, 4]
    assert [s["step"] for s in b.syncs] == [1, 2, 3, 4]
    assert_same_outer_state(a, b)
    for pa, pb in zip(a.params, b.params):
        assert torch.equal(pa, pb)


def test_a_group_that_joins_late_heals_the_outer_state_and_joins_at_a_sync():
    cfg = Config(sync_every=4, num_fragments=2, delay=1, syncs=6)
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=1000
    )
    late_start = threading.Event()
    try:
        with ThreadPoolExecutor(2) as pool:
            early = pool.submit(
                run_group, lighthouse.address(), 0, cfg, reached=(2, late_start),
                step_sleep=0.05, min_replica_size=1,
            )  # fmt: skip
            late = pool.submit(
                run_group, lighthouse.address(), 1, cfg, started=late_start, min_replica_size=1
            )
            a, b = early.result(timeout=80), late.result(timeout=80)
    finally:
        lighthouse.shutdown()
    # The late group's first sync was a heal to a step >= 2 (the schedule of
    # fragments came with the Manager's step), not a sync of its own step 0.
    assert b.syncs[0]["step"] >= 3
    assert len(b.syncs) < len(a.syncs)
    assert_same_outer_state(a, b)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"sync_every": 1, "num_fragments": 2}, r"sync_every \(1\) is less than the 2 fragments"),
        ({"sync_every": 5, "num_fragments": 2}, r"must be a multiple of the number of fragments"),
        ({"sync_every": 4, "num_fragments": 2, "fragment_sync_delay": 2}, r"less than .* \(2\)"),
        ({"fragment_update_alpha": 1.5}, r"fragment_update_alpha \(1.5\) must be between 0 and 1"),
        ({"outers": 3}, r"3 outer optimizers for 1 model fragments"),
        ({"use_async_quorum": True}, r"use_async_quorum=False"),
    ],
)
def test_bad_diloco_arguments_are_clear_errors(kwargs, match):
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = make_model()
    inner = torch.optim.AdamW(model.parameters())
    manager = small_replica(
        0, 0, 1, store, lighthouse.address(), model, inner,
        use_async_quorum=kwargs.pop("use_async_quorum", False),
    )  # fmt: skip
    try:
        frags = fragments_of(model, kwargs.pop("num_fragments", 1))
        num_outers = kwargs.pop("outers", len(frags))
        outers = [outer_optimizer(model.parameters()) for _ in range(num_outers)]
        kwargs.setdefault("sync_every", 4)
        with pytest.raises(ValueError, match=match):
            DiLoCo(manager, frags, inner, outers, **kwargs)
        with pytest.raises(ValueError, match=r"sync_every \(0\) must be at least 1"):
            LocalSGD(manager, model, inner, sync_every=0)
    finally:
        manager.shutdown()
        lighthouse.shutdown()
