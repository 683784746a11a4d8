"""Cost of durable checkpoints while training, against training without them.

    python -m bench.checkpoint_overhead [--hidden 2500] [--every 100] [--repeats 3]

One process, one training thread (torch.set_num_threads(1)), an MLP of 4
layers of width 2500 (25M parameters) with AdamW, batch 32. Interleaves,
`repeats` times, two windows of `every` training steps: A without
checkpoints; B with a DurableCheckpointer (every_steps=`every`) that saves
at the window's first step, so its background DCP write overlaps the rest
of the window, as in training. Reports the median window per contender, the
blocking copy of the state (stage_ms), and B's cost over A as a share of
step time (target: at most 2% at one checkpoint per 100 steps).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn

from bench._report import add_common_args, report, results_file
from torchft_like.checkpointing.durable import DurableCheckpointer


class _Trainer:
    """Model, AdamW and step count, with the Manager calls the checkpointer makes."""

    def __init__(self, hidden: int, layers: int) -> None:
        torch.manual_seed(0)
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.model = nn.Sequential(*blocks)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(32, hidden)
        self.step = 0

    def train_step(self) -> None:
        self.optim.zero_grad()
        self.model(self.x).square().mean().backward()
        self.optim.step()
        self.step += 1

    def current_step(self) -> int:
        return self.step

    def participating_rank(self) -> int | None:
        return 0

    def full_state_dict(self) -> dict[str, Any]:
        return {
            "user": {
                "default": {"model": self.model.state_dict(), "optim": self.optim.state_dict()}
            },
            "torchft": {"step": self.step, "batches_committed": self.step},
        }

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError("the benchmark only saves")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--hidden", type=int, default=2500, help="MLP width (2500: 25M params)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--every", type=int, default=100, help="steps per checkpoint (window)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds A B")
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.every, args.repeats = 64, 2, 5, 1
    torch.set_num_threads(1)
    trainer = _Trainer(args.hidden, args.layers)
    num_params = sum(p.numel() for p in trainer.model.parameters())
    trainer.train_step()  # AdamW state exists from here on

    with tempfile.TemporaryDirectory(prefix="ckpt_bench_") as directory:
        saver = DurableCheckpointer(trainer, directory, args.every, keep=1, group_rank=0,
                                    group_world_size=1)  # fmt: skip

        def window(save: bool) -> float:
            # Start at a multiple of `every` so B's first step is a save.
            trainer.step = -1 + args.every * (trainer.step // args.every + 1)
            start = time.perf_counter()
            for _ in range(args.every):
                trainer.train_step()
                if save:
                    saver.maybe_save()
            saver.wait()  # a write still going belongs to this window
            return time.perf_counter() - start

        times: dict[str, list[float]] = {"A no checkpoint": [], "B checkpoint": []}
        stage: list[float] = []
        for _ in range(args.repeats):
            times["A no checkpoint"].append(window(save=False))
            times["B checkpoint"].append(window(save=True))
            stage.append(saver.stage_s)
        saver.close()

    base = statistics.median(times["A no checkpoint"])
    step_ms = 1000 * base / args.every
    rows = []
    for name, ts in times.items():
        median = statistics.median(ts)
        rows.append(
            {
                "what": name,
                "params_M": round(num_params / 1e6, 1),
                "every": args.every,
                "window_median_s": round(median, 3),
                "window_min_s": round(min(ts), 3),
                "window_max_s": round(max(ts), 3),
                "step_ms": round(1000 * median / args.every, 2),
                "stage_ms": round(1000 * statistics.median(stage), 1) if name[0] == "B" else "",
                "overhead_pct": round(100 * (median / base - 1), 2),
                "base_step_ms": round(step_ms, 2),
            }
        )
    report(rows, results_file(args.out, "checkpoint_overhead"))


if __name__ == "__main__":
    main()
