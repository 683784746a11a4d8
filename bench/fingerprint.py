"""Cost of the divergence fingerprint, against the cost of a training step.

    python -m bench.fingerprint [--hidden 2500] [--repeats 9] [--device cpu]

One process, one thread (torch.set_num_threads(1)), an MLP of 4 layers of
width 2500 (25M parameters) with AdamW. Interleaves, `repeats` times:
A = fingerprint of the parameters (Manager(fingerprint_fn=model.parameters)),
B = fingerprint of the state healing copies (model and AdamW state dicts,
the Manager's default), C = one plain training step (batch 32: forward,
backward, AdamW step). Reports medians, min/max, and the cost per step of a
fingerprint every 10 steps relative to the step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from bench._report import add_common_args, report, results_file
from torchft_like.manager.fingerprint import fingerprint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--hidden", type=int, default=2500, help="MLP width (2500: 25M params)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds A B C")
    parser.add_argument("--interval", type=int, default=10, help="K: fingerprint every K steps")
    parser.add_argument("--device", default="cpu")
    add_common_args(parser)
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.repeats = 64, 2, 1
    torch.set_num_threads(1)
    device = torch.device(args.device)

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    model = nn.Sequential(*layers).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(32, args.hidden, device=device)
    num_params = sum(p.numel() for p in model.parameters())

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def train_step() -> None:
        optim.zero_grad()
        model(x).square().mean().backward()
        optim.step()
        sync()

    def params() -> None:
        fingerprint(model.parameters())

    def full_state() -> None:
        fingerprint({"m": model.state_dict(), "o": optim.state_dict()})

    contenders = {"params": params, "params+adamw": full_state, "train step": train_step}
    train_step()  # warm-up, and AdamW state exists from here on
    for fn in contenders.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeats):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1000)
    step_ms = statistics.median(times["train step"])
    rows = []
    for name, ts in times.items():
        median = statistics.median(ts)
        rows.append(
            {
                "what": name,
                "params_M": round(num_params / 1e6, 1),
                "device": str(device),
                "median_ms": round(median, 1),
                "min_ms": round(min(ts), 1),
                "max_ms": round(max(ts), 1),
                f"per_step_at_K{args.interval}_pct": (
                    round(100 * median / args.interval / step_ms, 1) if name != "train step" else ""
                ),
            }
        )
    report(rows, results_file(args.out, "fingerprint"))


if __name__ == "__main__":
    main()
