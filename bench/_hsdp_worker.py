"""One rank of bench/hsdp.py: plain torch HSDP (a 2-D mesh over every rank) or
FT-HSDP (this replica group's ranks shard, the Manager replicates).

Started without torchrun: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come
from the driver. Writes one JSON object to --out (per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--mode", choices=("plain", "ft"), required=True)
parser.add_argument("--transport", choices=("http", "pg"), default="http")
parser.add_argument("--groups", type=int, default=2, help="plain: replicate size of the mesh")
parser.add_argument("--group", type=int, default=0, help="ft: this replica group's id")
parser.add_argument("--hidden", type=int, default=1024)
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--warmup", type=int, default=5)
parser.add_argument("--stop-file", default="", help="ft: train on until this holds a step")
parser.add_argument("--out", required=True)
args = parser.parse_args()
torch.set_num_threads(1)
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
timeout = timedelta(seconds=30)
dist.init_process_group("gloo", timeout=timeout)


def build(mesh: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(args.hidden, args.hidden) for _ in range(4)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step * 1000 + RANK + 100 * args.group)
    return torch.randn(32, args.hidden, generator=gen)


def local_bytes(state: object) -> int:
    if isinstance(state, dict):
        return sum(local_bytes(v) for v in state.values())
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


result: dict = {}
if args.mode == "plain":
    mesh = init_device_mesh(
        "cpu", (args.groups, WORLD // args.groups), mesh_dim_names=("dp_replicate", "dp_shard")
    )
    model, optimizer = build(mesh)
    times = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            cpu_start = time.process_time()
        start = time.perf_counter()
        optimizer.zero_grad()
        model(batch(step)).pow(2).mean().backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    cpu = (time.process_time() - cpu_start) / args.steps
    result = {"times": times[args.warmup :], "cpu_per_step": cpu}
else:
    from torchft_like import Manager, Optimizer, ProcessGroupGloo
    from torchft_like.checkpointing.pg_transport import PGTransport
    from torchft_like.device_mesh import ft_init_device_mesh
    from torchft_like.hsdp import HSDPState

    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        replica_id=f"bench_hsdp_{args.group}",
        hostname="127.0.0.1",
        timeout=timeout,
        quorum_timeout=timedelta(seconds=120),
        connect_timeout=timeout,
        checkpoint_transport=(
            PGTransport(pg, timeout, torch.device("cpu")) if args.transport == "pg" else None
        ),
    )
    mesh = ft_init_device_mesh(
        device_type="cpu",
        mesh_shape=(2, WORLD),
        mesh_dim_names=("dp_replicate", "dp_shard"),
        replicate_dim=0,
        manager=manager,
    )
    model, inner = build(mesh)
    optimizer = Optimizer(manager, inner)
    state = HSDPState(model, inner)
    manager.set_state_dict_fns(state.load_state_dict, state.state_dict)
    times, heal = [], None
    results = Path(args.out)

    def stop_step() -> int:
        try:
            return int(Path(args.stop_file).read_text())
        except (OSError, ValueError):
            return 10**9

    turn = 0
    while manager.current_step() < stop_step():
        if turn == args.warmup:
            cpu_start = time.process_time()
        start = time.perf_counter()
        optimizer.zero_grad()
        model(batch(manager.current_step())).pow(2).mean().backward()
        optimizer.step()
        elapsed = time.perf_counter() - start
        turn += 1
        if manager.did_heal() and heal is None and manager.current_step() > 1:  # not init_sync
            heal = manager.timings().get("heal_recv_s")
            result["heal_s"] = heal
            result["shard_bytes"] = local_bytes(state.state_dict())
            result["heal_step"] = manager.current_step()
            results.write_text(json.dumps(result))
        if args.warmup < turn <= args.warmup + args.steps:
            times.append(elapsed)
            if len(times) == args.steps:
                result["times"] = times
                result["cpu_per_step"] = (time.process_time() - cpu_start) / args.steps
                results.write_text(json.dumps(result))
        if not args.stop_file and len(times) == args.steps:
            break
    manager.shutdown()

full = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # weights + 2 moments
result["full_state_bytes"] = full
if result.get("times"):
    result["median_s"] = statistics.median(result["times"])
Path(args.out).write_text(json.dumps(result))
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # skip finalization, where gloo's threads can abort a finished process
