"""One rank of bench.step_overhead, launched by torchrun.

    plain:   torch DDP over a gloo group of all ranks (torchrun's world).
    ft:      torchft_like DDP, this torchrun being one replica group.
    torchft: pytorch/torchft's DDP, the same way (reference only).

Rank 0 writes JSON: the measured per-step seconds, the CPU seconds per
step of this process (all its threads: less sensitive to other load on the
machine than wall time) and, for ft and torchft, the RPCs the step sent
(counted by bench._rpc_count). With --profile DIR it also writes a
torch.profiler table of a few more steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bench import _rpc_count

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["plain", "ft", "torchft"], required=True)
parser.add_argument("--hidden", type=int, required=True)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--warmup", type=int, default=10)
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--out", required=True)
parser.add_argument("--profile", default="", help="directory for a torch.profiler table")
args = parser.parse_args()
torch.set_num_threads(1)
_rpc_count.install()

torch.manual_seed(0)
layers: list[nn.Module] = []
for _ in range(args.layers):
    layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
model = nn.Sequential(*layers)
inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(args.batch, args.hidden)
group = os.environ.get("REPLICA_GROUP_ID", "0")

if args.mode == "plain":
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = inner
    manager = None
else:
    if args.mode == "ft":
        import torchft_like as ft
    else:
        import torchft as ft  # type: ignore[no-redef]

    manager = ft.Manager(
        pg=ft.ProcessGroupGloo(timeout=timedelta(seconds=60)),
        load_state_dict=lambda sd: (model.load_state_dict(sd["m"]), inner.load_state_dict(sd["o"])),
        state_dict=lambda: {"m": model.state_dict(), "o": inner.state_dict()},
        min_replica_size=2,
        replica_id=f"bench{group}",
        timeout=timedelta(seconds=60),
    )
    if args.mode == "torchft":
        # Its Rust client is out of grpc's reach: count the calls into it.
        rpcs = {"_quorum": "Quorum", "should_commit": "ShouldCommit"}
        manager._client = _rpc_count.CountingProxy(manager._client, rpcs)
    ddp = ft.DistributedDataParallel(manager, model)
    optimizer = ft.Optimizer(manager, inner)


def train_step() -> None:
    optimizer.zero_grad()
    ddp(x).pow(2).mean().backward()
    optimizer.step()


times = []
for _ in range(args.warmup):
    train_step()
rpcs_before = _rpc_count.snapshot()
cpu_start = time.process_time()
for _ in range(args.steps):
    start = time.perf_counter()
    train_step()
    times.append(time.perf_counter() - start)
cpu_per_step = (time.process_time() - cpu_start) / args.steps
rpcs_after = _rpc_count.snapshot()

rank = int(os.environ.get("RANK", 0))
if args.profile:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for _ in range(5):
            train_step()
    if rank == 0:
        out = Path(args.profile)
        out.mkdir(parents=True, exist_ok=True)
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
        (out / f"{args.mode}{group}_h{args.hidden}.txt").write_text(table)
        prof.export_chrome_trace(str(out / f"{args.mode}{group}_h{args.hidden}.json"))

if rank == 0:
    with open(args.out, "w") as f:
        json.dump(
            {
                "times": times,
                "cpu_per_step": cpu_per_step,
                "rpcs": {m: n - rpcs_before.get(m, 0) for m, n in rpcs_after.items()},
                "rpcs_per_step": _rpc_count.critical_per_step(rpcs_before, rpcs_after, args.steps),
            },
            f,
        )

if manager is not None:
    manager.shutdown()
else:
    del ddp
    dist.destroy_process_group()
# Skip interpreter finalization: there, gloo's worker threads can still hold
# tensors and abort the process (SIGABRT, "terminate called without an active
# exception"; seen once in CI with plain DDP), failing a run whose results
# are already written.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
