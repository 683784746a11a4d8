"""The device and backend choices of the HSDP helper and the demo, on CPU:
NCCL inside a group only on CUDA; the demo's CPU runs pass the CPU on, its
CUDA runs keep gloo between groups (one GPU holds them all)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from torchft_like.hsdp import group_backend

REPO = Path(__file__).resolve().parents[2]


def _demo():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("_demo_choices", REPO / "examples/demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    argv, sys.argv = sys.argv, ["demo.py"]
    try:
        spec.loader.exec_module(module)
    finally:
        sys.argv = argv
    return module


def test_nccl_inside_a_group_only_on_cuda() -> None:
    assert group_backend("cpu") == "gloo"
    assert group_backend(torch.device("cuda", 1)) == "nccl"


def test_the_demo_passes_the_device_on_and_keeps_gloo_across_groups_on_cuda() -> None:
    demo = _demo()
    assert demo.device_args("ddp", "cpu") == ["--device", "cpu"]
    assert demo.device_args("diloco", "cpu") == []
    assert demo.device_args("ddp", "cuda") == ["--device", "cuda", "--process-group", "gloo"]
    assert demo.device_args("fsdp", "cuda") == ["--device", "cuda"]
    assert demo.parse_args([]).device == "cpu"
