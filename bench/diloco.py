"""DiLoCo, streaming DiLoCo, LocalSGD and DDP: loss for the same tokens, bytes
sent, the cost of an inner step, and sync time against model size.

    python -m bench.diloco [--part table overhead sync] [--inner-steps 400] [--out DIR] [--smoke]

table: for each configuration, our lighthouse and two replica groups (each a
  torchrun of examples/train_diloco.py, one rank, OMP_NUM_THREADS=1): a
  byte-level transformer LM on the stdlib's sources, the same seed, the
  same --inner-steps per group (so the same tokens). Reports the held-out
  loss of each group at the end, and the bytes each group sent per inner
  step (per sync: a ring allreduce of the synced float32 parameters,
  2 (N-1)/N x 4 bytes each; quantized: the int8 alltoall + allgather,
  torchft_like.collectives.quantized_nbytes). Deterministic but for timing.
overhead: one process, a real lighthouse and Manager (one group): blocks
  of plain AdamW steps of the example's model, and of the same steps inside
  `with DiLoCo(...)` / `with LocalSGD(...)` (sync_every too large to sync),
  interleaved; the median step of each and their ratio.
sync: two groups as threads in one process (real lighthouse, real gloo), an
  MLP of 4 square layers; DiLoCo with sync_every=1, so every step syncs:
  the median time of a synced inner step minus a plain one, float32 and int8.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench._report import REPO, add_common_args, report, results_file
from bench.step_overhead import start_lighthouse
from tools.procs import free_port, wait_all

EXAMPLE = str(REPO / "examples" / "train_diloco.py")

STREAMING = ["--algo", "diloco", "--sync-every", "100", "--fragments", "4", "--delay", "5",
             "--alpha", "0.5"]  # fmt: skip
CONFIGS: list[tuple[str, list[str]]] = [
    ("ddp", ["--algo", "ddp", "--sync-every", "1"]),
    ("localsgd H=20", ["--algo", "localsgd", "--sync-every", "20"]),
    ("diloco H=20", ["--algo", "diloco", "--sync-every", "20"]),
    ("diloco H=20 int8", ["--algo", "diloco", "--sync-every", "20", "--quantize"]),
    ("diloco H=100", ["--algo", "diloco", "--sync-every", "100"]),
    ("streaming H=100 F=4 tau=5 a=0.5", STREAMING),
    ("streaming H=100 F=4 tau=5 a=0.5 int8", [*STREAMING, "--quantize"]),
]


# --- table ------------------------------------------------------------------------


def torchrun(flags: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """One torchrun of the example, one rank, its output in `log`."""
    pythonpath = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH")] if p)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
             "1", "--master_addr", "127.0.0.1", "--master_port", str(free_port()), EXAMPLE,
             *flags],
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath, **env},
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
    proc.log = log  # type: ignore[attr-defined]
    return proc


def run_config(name: str, flags: list[str], inner_steps: int, tmp: Path) -> dict[str, Any]:
    lighthouse, address = start_lighthouse("ft")
    start = time.monotonic()
    logs = [tmp / f"{name.replace(' ', '_')}_{g}.jsonl" for g in range(2)]
    try:
        groups = [
            torchrun(["--inner-steps", str(inner_steps), "--log-json", str(logs[g]), *flags],
                     {"TORCHFT_LIGHTHOUSE": address, "REPLICA_GROUP_ID": str(g),
                      "NUM_REPLICA_GROUPS": "2"},
                     tmp / f"{name.replace(' ', '_')}_{g}.log")
            for g in range(2)
        ]  # fmt: skip
        wait_all(groups, name, timeout_s=1800)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    finals = [json.loads(p.read_text().splitlines()[-1]) for p in logs]
    steps = [json.loads(line) for line in logs[0].read_text().splitlines()]
    steps = [r for r in steps if r["event"] == "inner"]
    return {
        "config": name,
        "tokens_per_group": finals[0]["tokens"],
        "eval_loss_g0": round(finals[0]["eval_loss"], 4),
        "eval_loss_g1": round(finals[1]["eval_loss"], 4),
        "bytes_per_step": round(finals[0]["bytes_sent"] / finals[0]["inner_steps"]),
        "syncs": finals[0]["step"],
        "median_step_ms": round(1000 * statistics.median(r["step_s"] for r in steps), 1),
        "wall_s": round(time.monotonic() - start, 1),
    }


# --- overhead -----------------------------------------------------------------------


def _example_model(d: int = 64, layers: int = 2, seq: int = 64) -> nn.Module:
    blocks = [
        nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        for _ in range(layers)
    ]
    return nn.Sequential(nn.Embedding(256, d), *blocks, nn.LayerNorm(d), nn.Linear(d, 256))


def _manager(lighthouse: str, group: int, model: nn.Module, inner: Any, **kw: Any) -> Any:
    from torch.distributed import TCPStore

    from torchft_like import Manager, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    t = timedelta(seconds=30)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=t), min_replica_size=1, use_async_quorum=False,
        rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
        lighthouse_addr=lighthouse, replica_id=f"bench{group}", hostname="127.0.0.1",
        timeout=t, connect_timeout=t, init_sync=False, **kw,
        load_state_dict=lambda sd: None, state_dict=lambda: {},
    )  # fmt: skip
    manager._bench_store = store  # keep the store alive with the manager
    return manager


def overhead(rounds: int, block: int) -> list[dict[str, Any]]:
    from lighthouse import LighthouseServer
    from torchft_like.local_sgd import DiLoCo, LocalSGD

    torch.manual_seed(0)
    model = _example_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(256, (8, 64))
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    manager = _manager(lighthouse.address(), 0, model, inner)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    diloco = DiLoCo(manager, [model], inner, outer, sync_every=10**9)
    local_sgd = LocalSGD(manager, model, inner, sync_every=10**9)
    times: dict[str, list[float]] = {"plain": [], "diloco": [], "localsgd": []}

    def step() -> float:
        start = time.perf_counter()
        inner.zero_grad()
        nn.functional.cross_entropy(model(x).reshape(-1, 256), x.reshape(-1)).backward()
        inner.step()
        return time.perf_counter() - start

    contexts = {"plain": contextlib.nullcontext(), "diloco": diloco, "localsgd": local_sgd}
    order = list(contexts)
    shuffle = random.Random(0).shuffle
    try:
        for _ in range(block):  # warm-up
            step()
        for _ in range(rounds):  # short blocks in a new order each round: load drifts
            shuffle(order)
            for name in order:
                with contexts[name]:
                    times[name] += [step() for _ in range(block)]
        # The hooks alone (what a step pays outside syncs), timed directly.
        hook_us = {}
        for name, algo in (("diloco", diloco), ("localsgd", local_sgd)):
            calls = 20000
            start = time.perf_counter()
            for _ in range(calls):
                algo._step_pre_hook(inner, (), {})
                algo._step_post_hook(inner, (), {})
            hook_us[name] = 1e6 * (time.perf_counter() - start) / calls
    finally:
        manager.shutdown()
        lighthouse.shutdown()
    plain = statistics.median(times["plain"])
    return [
        {
            "wrapper": name,
            "params": sum(p.numel() for p in model.parameters()),
            "median_step_ms": round(1000 * statistics.median(ts), 3),
            "plain_step_ms": round(1000 * plain, 3),
            "ratio": round(statistics.median(ts) / plain, 4),
            "hooks_us": round(hook_us[name], 2),
            "hooks_share": round(hook_us[name] / 1e6 / plain, 6),
            "steps": len(ts),
        }
        for name, ts in times.items()
        if name != "plain"
    ]


# --- sync ---------------------------------------------------------------------------


def sync_time(width: int, quantize: bool, syncs: int) -> dict[str, Any]:
    from lighthouse import LighthouseServer
    from torchft_like.collectives import quantized_nbytes, ring_allreduce_nbytes
    from torchft_like.local_sgd import DiLoCo

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    barrier = threading.Barrier(2)

    def group(g: int) -> tuple[list[float], list[float], int]:
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        manager = _manager(lighthouse.address(), g, model, inner)
        x = torch.randn(1, width)

        def step() -> float:
            start = time.perf_counter()
            inner.zero_grad()
            model(x).sum().backward()
            inner.step()
            return time.perf_counter() - start

        try:
            plain = [step() for _ in range(syncs + 1)][1:]
            with DiLoCo(manager, [model], inner, outer, sync_every=1, should_quantize=quantize):
                barrier.wait(60)
                synced = [step() for _ in range(syncs + 1)][1:]  # the first joins the quorum
        finally:
            manager.shutdown()
        return plain, synced, sum(p.numel() for p in model.parameters())

    try:
        with ThreadPoolExecutor(2) as pool:
            (plain, synced, numel), _ = pool.map(group, range(2))
    finally:
        lighthouse.shutdown()
    nbytes = sum(
        (quantized_nbytes if quantize else ring_allreduce_nbytes)(width * width + width, 2)
        for _ in range(4)
    )
    extra = statistics.median(synced) - statistics.median(plain)
    return {
        "params_m": round(numel / 1e6, 2),
        "int8": quantize,
        "sync_ms": round(1000 * extra, 1),
        "plain_step_ms": round(1000 * statistics.median(plain), 1),
        "mb_sent_per_sync": round(nbytes / 1e6, 2),
        "syncs": syncs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--part", nargs="+", default=["table", "overhead", "sync"])
    parser.add_argument("--inner-steps", type=int, default=400, help="per group (table)")
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    add_common_args(parser)
    args = parser.parse_args()
    inner_steps = 20 if args.smoke else args.inner_steps
    if "table" in args.part:
        with tempfile.TemporaryDirectory() as tmp:
            # Smoke: DDP and DiLoCo (LocalSGD has its own tests in tests/integration).
            configs = [CONFIGS[0], CONFIGS[2]] if args.smoke else CONFIGS
            rows = [run_config(n, f, inner_steps, Path(tmp)) for n, f in configs]
        report(rows, results_file(args.out, "diloco_table"))
    if "overhead" in args.part:
        rounds, block = (3, 5) if args.smoke else (40, 5)
        report(overhead(rounds, block), results_file(args.out, "diloco_overhead"))
    if "sync" in args.part:
        widths = args.widths[:1] if args.smoke else args.widths
        rows = [sync_time(w, q, 3 if args.smoke else 7) for w in widths for q in (False, True)]
        report(rows, results_file(args.out, "diloco_sync"))


if __name__ == "__main__":
    sys.exit(main())
