"""Fault-tolerant training with Ray Train's TorchftConfig, on torchft_like.

    python examples/ray_train.py [--workers 3] [--steps 60] [--fail-at 20] [--address auto]

Ray is how a job spans many machines: on the head node `ray start --head`,
on the others `ray start --address HEAD:6379`, then this script once, on the
head node. Ray's TorchTrainer runs one replica group per worker;
TorchftConfig starts the lighthouse as a Ray actor, and when a worker fails
Ray starts a replacement group while the others train on.

The training function below is written for torchft (`import torchft`), as
Ray's own example is: TORCHFT_LIKE_AS_TORCHFT=1 in every worker's
environment (the runtime_env below) makes those imports torchft_like's.
Worker 0 raises at step --fail-at, once; its replacement heals the live
state from a survivor over the process group (PGTransport) and trains to the
end. Each worker writes its final step and a hash of its state into --out;
the script says whether every replica ended identical, and exits 1 if not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import ray
import ray.train
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.train.v2.torch.torchft_config import TorchftConfig
from torch import nn

FEATURES, SAMPLES = 16, 4096


def train_func(config: dict) -> None:
    """One replica group (one Ray worker). torchft's API, unmodified."""
    from torchft import (
        DistributedDataParallel,
        DistributedSampler,
        Manager,
        Optimizer,
        ProcessGroupGloo,
    )
    from torchft.checkpointing.pg_transport import PGTransport

    torch.set_num_threads(1)
    context = ray.train.get_context()
    group, groups = context.get_world_rank(), context.get_world_size()
    out = Path(config["out"])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    timeout = timedelta(seconds=30)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            inner.load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"ray_train_{group}",
        rank=0,  # each worker is a replica group of one rank (Ray's RANK counts all workers)
        world_size=1,
        timeout=timedelta(seconds=60),
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    dataset = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    sampler = DistributedSampler(dataset, replica_rank=group, num_replica_groups=groups,
                                 group_rank=0, num_replicas=1)  # fmt: skip
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler, drop_last=True)
    batches = iter(loader)
    fail_marker = out / "failed_once"

    while manager.current_step() < config["steps"]:
        try:
            xb, yb = next(batches)
        except StopIteration:
            batches = iter(loader)
            xb, yb = next(batches)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(xb), yb)
        loss.backward()
        optimizer.step()
        step = manager.current_step()
        if manager.did_heal():
            print(f"group {group}: healed at step {step}", flush=True)
        if group == config["fail_group"] and step >= config["fail_at"] and not fail_marker.exists():
            fail_marker.touch()
            raise RuntimeError(f"injected failure of group {group} at step {step}")
        if step % 10 == 0:
            ray.train.report({"step": step, "loss": loss.item()})
        time.sleep(config["step_sleep"])

    digest = hashlib.sha256()
    for tensor in [*model.state_dict().values(), *_optimizer_tensors(inner)]:
        digest.update(tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    final = {"group": group, "step": manager.current_step(), "hash": digest.hexdigest()[:16],
             "loss": loss.item()}  # fmt: skip
    (out / f"final_{group}.json").write_text(json.dumps(final))
    manager.shutdown()


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = optimizer.state_dict()["state"]
    return [v for i in sorted(state) for _, v in sorted(state[i].items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--workers", type=int, default=3, help="replica groups (Ray workers)")
    parser.add_argument("--steps", type=int, default=60, help="committed steps to train")
    parser.add_argument("--fail-at", type=int, default=20, help="step at which a group fails")
    parser.add_argument("--fail-group", type=int, default=0, help="the group that fails")
    parser.add_argument("--step-sleep", type=float, default=0.05, help="seconds per step")
    parser.add_argument("--address", default=None, help="Ray cluster (default: a local one)")
    parser.add_argument("--out", default=None, help="where workers write their final state")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="ray_train_"))
    out.mkdir(parents=True, exist_ok=True)
    env = {"TORCHFT_LIKE_AS_TORCHFT": "1", "OMP_NUM_THREADS": "1"}
    # Local runs get a CPU per worker and one for the lighthouse whatever the machine.
    resources = {} if args.address else {"num_cpus": args.workers + 1}
    ray.init(address=args.address, runtime_env={"env_vars": env}, **resources)
    trainer = TorchTrainer(
        train_loop_per_worker=train_func,
        train_loop_config={"steps": args.steps, "fail_at": args.fail_at, "out": str(out),
                           "fail_group": args.fail_group, "step_sleep": args.step_sleep},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        torch_config=TorchftConfig(lighthouse_kwargs={"min_replicas": 1}, backend="gloo"),
        run_config=RunConfig(storage_path=str(out / "ray"),
                             failure_config=FailureConfig(max_failures=3)),
    )  # fmt: skip
    trainer.fit()
    finals = [json.loads(p.read_text()) for p in sorted(out.glob("final_*.json"))]
    for f in finals:
        print(f"group {f['group']}: step {f['step']} loss {f['loss']:.4f} state {f['hash']}")
    identical = len(finals) == args.workers and len({(f["step"], f["hash"]) for f in finals}) == 1
    print(f"replicas identical: {'yes' if identical else 'NO'} ({out})")
    sys.exit(0 if identical else 1)


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local demo cluster: no token files
    main()
