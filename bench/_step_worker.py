"""One rank of bench.step_overhead, launched by torchrun.

    plain: torch DDP over a gloo group of all ranks (torchrun's world).
    ft:    torchft_like DDP, this torchrun being one replica group.

Prints one JSON line with the measured per-step seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["plain", "ft"], required=True)
parser.add_argument("--hidden", type=int, required=True)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--warmup", type=int, default=10)
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--out", required=True)
args = parser.parse_args()
torch.set_num_threads(1)

torch.manual_seed(0)
layers: list[nn.Module] = []
for _ in range(args.layers):
    layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
model = nn.Sequential(*layers)
inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(32, args.hidden)

if args.mode == "plain":
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = inner
    manager = None
else:
    from torchft_like import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)),
        load_state_dict=lambda sd: (model.load_state_dict(sd["m"]), inner.load_state_dict(sd["o"])),
        state_dict=lambda: {"m": model.state_dict(), "o": inner.state_dict()},
        min_replica_size=2,
        replica_id=f"bench{os.environ['REPLICA_GROUP_ID']}",
        timeout=timedelta(seconds=60),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)

times = []
for _ in range(args.warmup + args.steps):
    start = time.perf_counter()
    optimizer.zero_grad()
    ddp(x).pow(2).mean().backward()
    optimizer.step()
    times.append(time.perf_counter() - start)

if manager is not None:
    manager.shutdown()
else:
    dist.destroy_process_group()
if int(os.environ.get("RANK", 0)) == 0:
    with open(args.out, "w") as f:
        json.dump({"times": times[args.warmup :]}, f)
