"""One replica group of one rank for tests/e2e/test_gone_abort.py: a real
Manager, our DDP and optimizer over a small MLP, a collective timeout far
above the heartbeat timeout, and a JSON line per committed step.

It trains until --steps or until the test kills it. With --hold-after K,
once it has committed K steps with all --groups, it stops inside the next
step's first gradient allreduce (before sending anything: its peers wait in
theirs) after writing --hold-file, and stays there until the test stops or
kills it. Runs as its own process (a group of one rank hosts its own store, as torchrun's agent
would), so that SIGSTOP and SIGKILL hit exactly one group.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn
from torch.distributed import TCPStore

from torchft_like import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft_like.manager import gone_watch
from torchft_like.manager.gone_watch import StepBreaker
from torchft_like.process_group import ProcessGroupBabyGloo

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--lighthouse", required=True)
parser.add_argument("--group", type=int, required=True)
parser.add_argument("--log", required=True)
parser.add_argument("--steps", type=int, default=100_000)
parser.add_argument("--timeout-s", type=float, default=30.0)
parser.add_argument("--step-sleep", type=float, default=0.02)
parser.add_argument("--pg", choices=("gloo", "baby"), default="gloo")
parser.add_argument("--groups", type=int, default=2, help="groups of the job")
parser.add_argument(
    "--hold-after", type=int, default=None, help="hold once this many steps committed with all"
)
parser.add_argument("--hold-file", default=None)
parser.add_argument(
    "--go-file", default=None, help="after holding, go on with the allreduce once this exists"
)
parser.add_argument(
    "--no-freeze-veto", action="store_true", help="commit a step during which it was frozen"
)
parser.add_argument(
    "--no-abort", action="store_true", help="ignore gone notices (the behaviour before them)"
)
args = parser.parse_args()
logging.basicConfig(
    level=logging.INFO, format=f"%(asctime)s g{args.group} %(levelname)s %(name)s: %(message)s"
)
torch.set_num_threads(1)
if args.no_abort:
    StepBreaker.notice = lambda self, quorum_id, gone: None  # type: ignore[method-assign]
if args.no_freeze_veto:
    gone_watch.FROZEN_S = float("inf")

timeout = timedelta(seconds=args.timeout_s)
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
inner = torch.optim.SGD(model.parameters(), lr=0.01)
pg = ProcessGroupBabyGloo(timeout=timeout) if args.pg == "baby" else ProcessGroupGloo(timeout)
manager = Manager(
    pg=pg,
    load_state_dict=lambda sd: (model.load_state_dict(sd["m"]), inner.load_state_dict(sd["o"])),
    state_dict=lambda: {"m": model.state_dict(), "o": inner.state_dict()},
    min_replica_size=1,
    timeout=timeout,
    quorum_timeout=timedelta(seconds=60),
    connect_timeout=timedelta(seconds=10),
    rank=0,
    world_size=1,
    store_addr="127.0.0.1",
    store_port=store.port,
    lighthouse_addr=args.lighthouse,
    replica_id=f"stall_{args.group}",
    hostname="127.0.0.1",
    max_retries=1000,
)
together = 0
held = False
if args.hold_after is not None:
    allreduce = manager.allreduce

    def held_allreduce(tensor, *rest, **kwargs):  # type: ignore[no-untyped-def]
        global held
        if together >= args.hold_after and not held:
            held = True
            # Whole or absent: the test reads it as soon as it exists, then stops us.
            Path(args.hold_file + ".tmp").write_text(str(time.time()))
            os.replace(args.hold_file + ".tmp", args.hold_file)
            while args.go_file is None or not Path(args.go_file).exists():
                time.sleep(0.05)  # until SIGSTOP or SIGKILL, or told to go on
        return allreduce(tensor, *rest, **kwargs)

    manager.allreduce = held_allreduce  # type: ignore[method-assign]
ddp = DistributedDataParallel(manager, model)
optimizer = Optimizer(manager, inner)
gen = torch.Generator().manual_seed(args.group)
log = open(args.log, "a")

while manager.current_step() < args.steps:
    x = torch.randn(16, 32, generator=gen)
    optimizer.zero_grad()
    ddp(x).pow(2).mean().backward()
    before = manager.current_step()
    optimizer.step()
    record = {
        "t": time.time(),
        "step": manager.current_step(),
        "committed": manager.current_step() > before,
        "participants": manager.num_participants(),
        "quorum_id": manager.quorum_id(),
        "hash": hashlib.sha256(
            b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        ).hexdigest()[:16],
    }
    together += record["committed"] and record["participants"] == args.groups
    log.write(json.dumps(record) + "\n")
    log.flush()
    time.sleep(args.step_sleep)
os._exit(0)  # a dropped gloo group may still wait out a stuck collective
