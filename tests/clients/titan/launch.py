"""Runs torchtitan's trainer (`torchtitan.train.main`) on CPU, unpatched.

torchtitan picks its device type and device module when
`torchtitan.tools.utils` is imported, falling back to CUDA, and asks the
module for memory statistics and an integer device index. This launcher makes
torch report CPU as the available device while that import runs, and hands
torchtitan a view of `torch.cpu` with those few calls added (no allocator
statistics: empty; device index 0), so torchtitan selects `cpu` and gloo
itself; torch's own `torch.cpu` is left as it is. Two gaps of gloo and of
torch 2.13 are bridged below, each where it is done. Started by torchrun once per
replica group; the configs are in configs.py beside this file.
"""

import os
import sys
import types

import torch
import torch._utils


class _CpuDevice(types.ModuleType):
    """torch.cpu, plus what torchtitan's CUDA-shaped calls need."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device: object = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: object = None) -> types.SimpleNamespace:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(name="cpu", total_memory=total)

    @staticmethod
    def memory_stats(device: object = None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: object = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def _import_torchtitan_on_cpu() -> None:
    available, module = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type=None: _CpuDevice("torchtitan_cpu")
    try:
        import torchtitan.tools.utils  # noqa: F401  (reads the device once, here)
    finally:
        torch._utils._get_available_device_type = available
        torch._utils._get_device_module = module


def _sum_reduction_on_gloo() -> None:
    """torchtitan turns FSDP's gradient division off (a factor of 1), which
    FSDP sends as a PREMUL_SUM reduce-scatter: gloo has no PREMUL_SUM. FSDP's
    own "force sum reduction" gives the same gradients with a plain SUM."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as c

    factors = c._get_gradient_divide_factors

    def sum_reduction(*args: object) -> object:  # the caller passes all six positionally
        return factors(*args[:5], True)  # type: ignore[arg-type]

    c._get_gradient_divide_factors = sum_reduction


_import_torchtitan_on_cpu()
_sum_reduction_on_gloo()
# torchtitan 0.3.0 is written against torch's nightly, where the private
# `_set_pg_timeout` of torch 2.13 became public as `set_timeout`.
if not hasattr(torch.distributed, "set_timeout"):
    from torch.distributed.distributed_c10d import _set_pg_timeout

    torch.distributed.set_timeout = _set_pg_timeout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torchtitan.train import main  # noqa: E402

if __name__ == "__main__":
    main()
