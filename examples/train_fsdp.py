"""Fault-tolerant HSDP training of a small decoder-only transformer language model.

Each replica group is one torchrun job whose ranks shard the model with
FSDP2 (`fully_shard`); the groups replicate it, and only that dimension is
fault tolerant: FSDP2's gradient all-reduce across groups goes through the
Manager. Start a lighthouse, then one torchrun per replica group:

    torchft-lighthouse --min-replicas 1 --bind 127.0.0.1:29510 --http-bind 127.0.0.1:29511
    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 \\
        torchrun --standalone --nproc_per_node 2 examples/train_fsdp.py --steps 300
    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 \\
        torchrun --standalone --nproc_per_node 2 examples/train_fsdp.py --steps 300

Kill either group and start it again: rank r of the restarted group copies
its shard (weights and optimizer state) from rank r of a live group. Every
group needs the same number of ranks (a group that shards differently is
refused at its first heal).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from datetime import timedelta

START_TIME = time.time()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lighthouse import DuplicateGroupError, QuorumError  # noqa: E402
from torchft_like import (  # noqa: E402
    DistributedSampler,
    ManagedProcessGroup,
    Manager,
    Optimizer,
    ProcessGroupGloo,
    StepBatches,
)
from torchft_like.checkpointing.pg_transport import PGTransport  # noqa: E402
from torchft_like.hsdp import HSDPState, init_group_process_group  # noqa: E402

# --- arguments --------------------------------------------------------------

parser = argparse.ArgumentParser(
    allow_abbrev=False,  # a misspelled flag is an error, not a prefix match
    description=__doc__.split("\n")[0] + " Runs under torchrun, one process per rank.",
    epilog="environment: as examples/train_ddp.py (see its --help): torchrun's variables, "
    "REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE, TORCHFT_*",
)
parser.add_argument("--steps", type=int, default=300, help="committed steps to train")
parser.add_argument("--dim", type=int, default=64, help="model width")
parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
parser.add_argument("--heads", type=int, default=4, help="attention heads")
parser.add_argument("--vocab", type=int, default=256, help="vocabulary size")
parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
parser.add_argument("--seed", type=int, default=0, help="seed of the data and the weights")
parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
parser.add_argument("--log-json", default=None, help="rank 0 appends one JSON line per step")
parser.add_argument("--timeout-s", type=float, default=10, help="collective/transfer timeout")
parser.add_argument(
    "--transport", choices=("http", "pg"), default="http", help="how a healing rank gets its shard"
)
parser.add_argument(
    "--device",
    choices=("auto", "cpu", "cuda"),
    default="auto",
    help="auto: cuda (a GPU per rank, cuda:LOCAL_RANK, NCCL inside the group) when CUDA is "
    "available, else cpu (gloo)",
)
args = parser.parse_args()
if missing := [
    n for n in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if n not in os.environ
]:
    parser.exit(2, f"train_fsdp.py: error: {', '.join(missing)} not set: run it under torchrun\n")
if "REPLICA_GROUP_ID" not in os.environ:
    parser.exit(2, "train_fsdp.py: error: set REPLICA_GROUP_ID to this group's id (0, 1, ...)\n")

GROUP = int(os.environ["REPLICA_GROUP_ID"])
NUM_GROUPS = int(os.environ.get("NUM_REPLICA_GROUPS", 2))
RANK, WORLD_SIZE = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
logging.basicConfig(
    level=logging.INFO,
    format=f"%(asctime)s group{GROUP}/rank{RANK} %(levelname)s %(name)s: %(message)s",
)
log = logging.getLogger("train_fsdp")
torch.set_num_threads(1)

# The device is chosen at run time: a GPU per rank (cuda:LOCAL_RANK) with
# NCCL inside the group where there is one, else the CPU with gloo.
if args.device == "cuda" and not torch.cuda.is_available():
    parser.exit(2, "train_fsdp.py: error: --device cuda, but torch.cuda.is_available() is False\n")
device = init_group_process_group(None if args.device == "auto" else args.device)

# --- data: sequences from a fixed random bigram "language" -------------------

NUM_SEQUENCES = 4096
gen = torch.Generator().manual_seed(args.seed)
# Each token has a few likely successors: a next-token structure to learn.
successors = torch.randint(0, args.vocab, (args.vocab, 4), generator=gen)
tokens = torch.empty(NUM_SEQUENCES, args.seq_len + 1, dtype=torch.long)
tokens[:, 0] = torch.randint(0, args.vocab, (NUM_SEQUENCES,), generator=gen)
for t in range(args.seq_len):
    choice = torch.randint(0, 4, (NUM_SEQUENCES,), generator=gen)
    tokens[:, t + 1] = successors[tokens[:, t], choice]
dataset = TensorDataset(tokens)
# Every rank of every group reads its own part of the data.
sampler = DistributedSampler(dataset, replica_rank=GROUP, num_replica_groups=NUM_GROUPS)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

# --- model: a decoder-only transformer ---------------------------------------


class Block(nn.Module):
    """Pre-norm causal self-attention, then an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class DecoderLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# --- manager, mesh, sharding, optimizer ---------------------------------------

timeout = timedelta(seconds=args.timeout_s)
replicate_pg = ProcessGroupGloo(timeout=timeout)  # rank r of each group meets rank r of the others
try:
    manager = Manager(
        pg=replicate_pg,
        min_replica_size=1,
        replica_id=f"train_fsdp_{GROUP}",
        timeout=timeout,
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=10),
        max_retries=50,
        checkpoint_transport=(
            PGTransport(replicate_pg, timeout, device) if args.transport == "pg" else None
        ),
    )
except (QuorumError, ValueError) as e:
    log.error("%s", e)
    sys.exit(2)

# The mesh: the replicate dimension is a process group that goes through the
# Manager, registered by name as torch finds a mesh's groups; the shard
# dimension is this group's own world. (torchft_like.device_mesh's
# ft_init_device_mesh builds the same mesh in one call.)
managed = ManagedProcessGroup(manager).register("dp_replicate")
assert dist.group.WORLD is not None  # init_group_process_group made it
mesh = DeviceMesh.from_group(
    [managed, dist.group.WORLD],
    device.type,
    mesh=[list(range(WORLD_SIZE))],
    mesh_dim_names=("dp_replicate", "dp_shard"),
)

torch.manual_seed(args.seed)  # every group starts alike; init_sync copies group 0's anyway
model = DecoderLM(args.vocab, args.dim, args.layers, args.heads, args.seq_len).to(device)
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
inner_optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
optimizer = Optimizer(manager, inner_optimizer)
# What a restarted rank r copies from rank r of a live group: its shard.
state = HSDPState(model, inner_optimizer)
manager.set_state_dict_fns(state.load_state_dict, state.state_dict)
batches = StepBatches(manager, loader)
json_log = open(args.log_json, "a") if args.log_json and RANK == 0 else None
ready_time = time.time()
log.info(
    "ready in %.2f s (replica %s, device %s)", ready_time - START_TIME, manager.replica_id, device
)


def emit(record: dict) -> None:
    if json_log is not None:
        json_log.write(json.dumps(record) + "\n")
        json_log.flush()


def group_state_hash() -> str:
    """Hash of the whole group's state: every rank hashes its shard, rank 0
    hashes those. Equal across groups only if bit-identical."""
    digest = hashlib.sha256()
    local = {"model": model.state_dict(), "optim": inner_optimizer.state_dict()["state"]}
    for key, value in sorted(_leaves(local, "")):
        digest.update(key.encode())
        digest.update(value.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    hashes: list = [None] * WORLD_SIZE
    dist.all_gather_object(hashes, digest.hexdigest())
    return hashlib.sha256("".join(hashes).encode()).hexdigest()[:16]


def _leaves(obj: object, path: str) -> list:
    if isinstance(obj, dict):
        return [leaf for k, v in obj.items() for leaf in _leaves(v, f"{path}.{k}")]
    if isinstance(obj, torch.Tensor):
        return [(path, obj.to_local() if hasattr(obj, "to_local") else obj)]
    return []


emit({"event": "start", "t": START_TIME, "ready": ready_time, "replica_id": manager.replica_id})

# --- training loop ----------------------------------------------------------

try:
    while manager.current_step() < args.steps:
        (seq,) = next(batches)
        seq = seq.to(device)
        step_start = time.time()
        optimizer.zero_grad()
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), seq[:, 1:].reshape(-1))
        loss.backward()
        step_before = manager.current_step()
        optimizer.step()
        committed = manager.current_step() > step_before
        log.info(
            "step %d loss %.4f participants %d committed %s%s",
            manager.current_step(), loss.item(), manager.num_participants(), committed,
            " healed" if manager.did_heal() else "",
        )  # fmt: skip
        emit(
            {
                "event": "step", "t": time.time(), "step_s": time.time() - step_start,
                "step": manager.current_step(), "loss": loss.item(), "committed": committed,
                "participants": manager.num_participants(), "healed": manager.did_heal(),
                **manager.timings(),
            }
        )  # fmt: skip
        if args.step_sleep:
            time.sleep(args.step_sleep)
except DuplicateGroupError as e:
    log.error("%s", e)
    sys.exit(2)

final_hash = group_state_hash()
log.info("finished at step %d, state hash %s", manager.current_step(), final_hash)
emit({"event": "final", "t": time.time(), "step": manager.current_step(), "hash": final_hash})
manager.shutdown()
dist.destroy_process_group()
