"""Fault-tolerant low-communication training (DiLoCo, streaming DiLoCo, LocalSGD,
or plain DDP to compare) of a small byte-level transformer language model on
the Python standard library's own sources (read from this interpreter's
install: nothing is downloaded).

Start a lighthouse, then one torchrun per replica group:

    torchft-lighthouse --min-replicas 1 --bind 127.0.0.1:29510
    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 \\
        torchrun --standalone --nproc_per_node 1 examples/train_diloco.py --algo diloco
    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 \\
        torchrun --standalone --nproc_per_node 1 examples/train_diloco.py --algo diloco

Each group trains alone for --sync-every inner steps, then the groups average
their pseudo-gradients (DiLoCo) or parameters (LocalSGD) at one outer sync.
Kill a group and start it again: the others go on; at its first sync it
copies the live outer state and rejoins. Every rank of a group reads the same
batches; each group draws its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

START_TIME = time.time()  # before the heavy imports: start-up includes them

import torch  # noqa: E402
from torch import nn  # noqa: E402

from torchft_like import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo  # noqa: E402
from torchft_like.collectives import quantized_nbytes, ring_allreduce_nbytes  # noqa: E402
from torchft_like.local_sgd import DiLoCo, LocalSGD  # noqa: E402
from torchft_like.manager.fingerprint import fingerprint  # noqa: E402

# --- arguments --------------------------------------------------------------

parser = argparse.ArgumentParser(
    allow_abbrev=False,  # a misspelled flag is an error, not a prefix match
    description=__doc__.split("\n")[0] + " Runs under torchrun, one process per rank.",
    epilog="environment: as examples/train_ddp.py (REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, "
    "TORCHFT_LIGHTHOUSE, and torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)",
)
parser.add_argument(
    "--algo", choices=["diloco", "localsgd", "ddp"], default="diloco", help="how groups sync"
)
parser.add_argument("--sync-every", type=int, default=20, help="inner steps per outer sync (H)")
parser.add_argument("--fragments", type=int, default=1, help="streaming DiLoCo: model fragments")
parser.add_argument("--delay", type=int, default=0, help="streaming: fragment_sync_delay (tau)")
parser.add_argument("--alpha", type=float, default=0.0, help="streaming: fragment_update_alpha")
parser.add_argument("--quantize", action="store_true", help="send pseudo-gradients as int8")
parser.add_argument("--inner-steps", type=int, default=400, help="inner steps per group")
parser.add_argument(
    "--steps",
    type=int,
    default=None,
    help="committed syncs (Manager steps) to train instead of --inner-steps; a group that "
    "restarts stops with the others",
)
parser.add_argument("--batch-size", type=int, default=8, help="sequences per inner step")
parser.add_argument("--seq-len", type=int, default=64, help="bytes per sequence")
parser.add_argument("--d-model", type=int, default=64, help="transformer width")
parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
parser.add_argument("--heads", type=int, default=4, help="attention heads")
parser.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
parser.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov SGD rate")
parser.add_argument("--outer-momentum", type=float, default=0.9, help="outer momentum")
parser.add_argument("--corpus-mb", type=float, default=4.0, help="MB of stdlib sources to read")
parser.add_argument("--eval-batches", type=int, default=16, help="held-out batches to evaluate")
parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
parser.add_argument("--timeout-s", type=float, default=20, help="collective/transfer timeout")
parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
parser.add_argument("--log-json", default=None, help="append one JSON line per event here")
parser.add_argument(
    "--device",
    choices=("cpu", "cuda"),
    default="cpu",
    help="where the model trains: cuda is cuda:(LOCAL_RANK %% GPUs); the replicas' process "
    "group stays gloo (it takes CUDA tensors), so one GPU can hold every group",
)
args = parser.parse_args()
for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "REPLICA_GROUP_ID"):
    if name not in os.environ:
        parser.exit(2, f"train_diloco.py: error: {name} is not set; see the docstring (--help)\n")
if args.inner_steps % args.sync_every:
    parser.exit(2, "train_diloco.py: error: --inner-steps must be a multiple of --sync-every\n")

GROUP = int(os.environ["REPLICA_GROUP_ID"])
RANK = int(os.environ["RANK"])
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
logging.basicConfig(
    level=logging.INFO,
    format=f"%(asctime)s group{GROUP}/rank{RANK} %(levelname)s %(name)s: %(message)s",
)
log = logging.getLogger("train_diloco")
if args.device == "cuda":
    if not torch.cuda.is_available():
        parser.exit(
            2, "train_diloco.py: error: --device cuda, but torch.cuda.is_available() is False\n"
        )
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.cuda.set_device(device)
else:
    device = torch.device("cpu")

# --- data: bytes of the standard library's .py files ------------------------


def read_corpus(limit_bytes: int) -> torch.Tensor:
    """The stdlib's top-level modules, in name order, as one byte tensor."""
    root = Path(os.__file__).parent
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit_bytes]), dtype=torch.uint8).long()


corpus = read_corpus(int(args.corpus_mb * 1e6))
split = int(len(corpus) * 0.95)
train_data, val_data = corpus[:split], corpus[split:]


def batch(data: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(len(data) - args.seq_len - 1, (args.batch_size,), generator=generator)
    windows = torch.stack([data[s : s + args.seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def train_batch(inner_step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of this group's inner step: the same on every rank of the
    group, different across groups."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + GROUP * 7_919 + inner_step)
    return batch(train_data, g)


# --- model: a small decoder-only transformer over bytes ---------------------


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        d = args.d_model
        self.embed = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.randn(args.seq_len, d) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d, args.heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(args.layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256)
        mask = torch.triu(torch.full((args.seq_len, args.seq_len), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(x))

    def fragments(self, n: int) -> list[nn.Module]:
        """`n` consecutive slices of the model, for streaming DiLoCo."""
        parts: list[nn.Module] = [self.embed, *self.blocks, nn.ModuleList([self.norm, self.head])]
        if n > len(parts):
            raise ValueError(f"--fragments {n}: this model has only {len(parts)} parts")
        size = math.ceil(len(parts) / n)
        groups = [parts[i : i + size] for i in range(0, len(parts), size)]
        frags = [nn.ModuleList(g) for g in groups]
        # pos belongs to the first fragment
        frags[0].register_parameter("pos", self.pos)
        return frags


torch.manual_seed(args.seed)
model = TinyLM().to(device)
inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
criterion = nn.CrossEntropyLoss()
num_params = sum(p.numel() for p in model.parameters())


def lm_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return criterion(net(x.to(device)).reshape(-1, 256), y.to(device).reshape(-1))


@torch.no_grad()
def eval_loss() -> float:
    g = torch.Generator().manual_seed(12345)
    losses = [lm_loss(model, *batch(val_data, g)).item() for _ in range(args.eval_batches)]
    return sum(losses) / len(losses)


# --- manager and the algorithm ----------------------------------------------

timeout = timedelta(seconds=args.timeout_s)
manager = Manager(
    pg=ProcessGroupGloo(timeout=timeout),
    load_state_dict=lambda sd: (
        model.load_state_dict(sd["model"]),
        inner.load_state_dict(sd["optim"]),
    ),
    state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
    min_replica_size=1,
    use_async_quorum=args.algo == "ddp",
    replica_id=f"train_diloco_{GROUP}",
    timeout=timeout,
    quorum_timeout=timedelta(seconds=120),
    connect_timeout=timedelta(seconds=30),
    # All groups start from the same seed: no step-0 copy, so every group's
    # first H inner steps count.
    init_sync=False,
)
if args.algo == "ddp":
    ddp_model: nn.Module = DistributedDataParallel(manager, model)
    optimizer: torch.optim.Optimizer = Optimizer(manager, inner)
    steps_per_commit, algo = 1, None
elif args.algo == "localsgd":
    ddp_model, optimizer = model, inner
    steps_per_commit = args.sync_every
    algo = LocalSGD(manager, model, inner, sync_every=args.sync_every)
else:
    ddp_model, optimizer = model, inner
    fragments = model.fragments(args.fragments) if args.fragments > 1 else [model]
    outers = [
        torch.optim.SGD(
            f.parameters(), lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True
        )
        for f in fragments
    ]
    steps_per_commit = args.sync_every // args.fragments
    algo = DiLoCo(
        manager, fragments, inner, outers, sync_every=args.sync_every,
        should_quantize=args.quantize, fragment_sync_delay=args.delay,
        fragment_update_alpha=args.alpha,
    )  # fmt: skip
target_commits = args.steps if args.steps is not None else args.inner_steps // steps_per_commit
json_log = open(args.log_json, "a") if args.log_json and RANK == 0 else None


def emit(record: dict) -> None:
    if json_log is not None:
        json_log.write(json.dumps(record) + "\n")
        json_log.flush()


def sync_nbytes(step_committed: int) -> int:
    """Bytes this group sent in the sync just made (ring allreduce of floats,
    or the int8 alltoall + allgather), with the quorum's participant count."""
    world = max(manager.num_participants(), 1)
    if args.algo == "diloco":
        frag = fragments[(step_committed - 1) % len(fragments)]
        numels = [p.numel() for p in frag.parameters()]
    else:
        numels = [p.numel() for p in model.parameters()]
    count = quantized_nbytes if args.algo == "diloco" and args.quantize else ring_allreduce_nbytes
    return sum(count(n, world) for n in numels)


emit({
    "event": "start", "t": START_TIME, "ready": time.time(), "algo": args.algo,
    "params": num_params, "args": vars(args), "replica_id": manager.replica_id,
})  # fmt: skip
log.info("%s, %d parameters, %d committed syncs to go", args.algo, num_params, target_commits)


def state_hash() -> str:
    """Fingerprint of what every group must share after a sync: the global
    parameters and the outer optimizer (DiLoCo), else the model, and the
    Manager's step. Inner optimizer states are each group's own."""
    if args.algo != "diloco":
        return fingerprint({"step": manager.current_step(), "model": model.state_dict()})
    user = manager.full_state_dict()["user"]
    shared = [
        {
            k: user[f"StreamingDiLoCoFragment_{i}"][k]
            for k in ("original_parameters", "outer_optimizer")
        }
        for i in range(len(fragments))
    ]
    return fingerprint({"step": manager.current_step(), "fragments": shared})


# --- training loop ----------------------------------------------------------

inner_step, bytes_sent, tokens = 0, 0, 0
context = algo if algo is not None else contextlib.nullcontext()
with context:
    while manager.current_step() < target_commits:
        x, y = train_batch(inner_step)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = lm_loss(ddp_model, x, y)
        loss.backward()
        before = manager.current_step()
        optimizer.step()
        step_s = time.perf_counter() - start
        inner_step += 1
        tokens += x.numel()
        synced = manager.current_step() > before
        if synced:
            bytes_sent += sync_nbytes(manager.current_step())
        emit({
            "event": "inner", "t": time.time(), "inner_step": inner_step, "loss": loss.item(),
            "step_s": step_s, "synced": synced,
        })  # fmt: skip
        # A sync was attempted (the algorithm reset its count; DDP: every step):
        # one record per Manager step attempt, as examples/train_ddp.py writes.
        if algo is None or algo._local_step == 0:
            emit({
                "event": "step", "t": time.time(), "step": manager.current_step(),
                "loss": loss.item(), "committed": synced, "healed": manager.did_heal(),
                "participants": manager.num_participants(), "bytes_sent": bytes_sent,
                "tokens": tokens, "inner_step": inner_step, **manager.timings(),
            })  # fmt: skip
        if inner_step % 50 == 0:
            log.info(
                "inner step %d sync %d loss %.3f", inner_step, manager.current_step(), loss.item()
            )
        if args.step_sleep:
            time.sleep(args.step_sleep)

final = eval_loss()
log.info("finished: %d inner steps, eval loss %.4f, %d bytes sent", inner_step, final, bytes_sent)
emit({
    "event": "final", "t": time.time(), "inner_steps": inner_step, "tokens": tokens,
    "eval_loss": final, "bytes_sent": bytes_sent, "step": manager.current_step(),
    "hash": state_hash(), "quorum_id": manager.quorum_id(),
})  # fmt: skip
manager.shutdown()
sys.exit(0)
