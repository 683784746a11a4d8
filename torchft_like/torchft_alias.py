"""`import torchft` resolves to torchft_like: code written for torchft
(torchtitan, Ray Train's TorchftConfig, a user's script) runs unmodified.

Each torchft module path is the same module object as torchft_like's of that
path (`torchft.manager is torchft_like.manager`), so `isinstance`,
`mock.patch("torchft.manager.X")` and the loggers' names (torchft_like's)
behave as with any alias. A torchft module or name torchft_like does not
have fails at import with an ImportError naming it and pointing to
docs/differences.md ("Differences from torchft").

Two ways in: `install_as_torchft()` before the first `import torchft`, or
TORCHFT_LIKE_AS_TORCHFT=1 in the environment of a fresh interpreter
(torchrun, Ray workers), honoured by the start-up hook that installing this
package puts in site-packages (`_torchft_like_startup`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

DIFFERENCES = "see 'Differences from torchft' in torchft_like's docs/differences.md"

MODULES = {
    "torchft": "torchft_like",
    "torchft.checkpointing": "torchft_like.checkpointing",
    "torchft.checkpointing.http_transport": "torchft_like.checkpointing.http_transport",
    "torchft.checkpointing.pg_transport": "torchft_like.checkpointing.pg_transport",
    "torchft.checkpointing.transport": "torchft_like.checkpointing.transport",
    "torchft.collectives": "torchft_like.collectives",
    "torchft.coordination": "torchft_like.coordination",
    "torchft.data": "torchft_like.data",
    "torchft.ddp": "torchft_like.ddp",
    "torchft.device_mesh": "torchft_like.device_mesh",
    "torchft.local_sgd": "torchft_like.local_sgd",
    "torchft.manager": "torchft_like.manager",
    "torchft.optim": "torchft_like.optim",
    "torchft.process_group": "torchft_like.process_group",
    "torchft.quantization": "torchft_like.quantization",
    "torchft.torchx": "torchft_like.torchx",
}
"""Every torchft module path that torchft_like has, and its module."""

MISSING_MODULES = {
    "torchft._torchft": "torchft's Rust extension; its servers and clients are in "
    "torchft.coordination",
    "torchft.torchcomms": "no torchcomms process group; use process_group='gloo'",
    "torchft.otel": "no OpenTelemetry logging; torchft_like logs through `logging` and serves "
    "Prometheus metrics",
    "torchft.parameter_server": "no parameter server",
    "torchft.multiprocessing": "no _MonitoredPipe: ProcessGroupBabyGloo keeps its own socket",
    "torchft.work": "no torchft Work classes; works are torch.distributed.Work",
}
"""torchft modules torchft_like does not have, and what to use instead."""

_NO_XCCL = (
    "no XCCL process groups (Intel GPUs), nor their Baby subprocess form; on NVIDIA GPUs use "
    "ProcessGroupNCCL or ProcessGroupBabyNCCL, on CPUs ProcessGroupGloo"
)
REFUSED_WHEN_BUILT = {
    module: dict.fromkeys(("ProcessGroupXCCL", "ProcessGroupBabyXCCL"), _NO_XCCL)
    for module in ("torchft_like", "torchft_like.process_group")
}
"""torchft names that import but refuse to be built, by module, and why:
torchft's own examples import ProcessGroupXCCL on every machine and build
it only on an Intel GPU (its train_ddp.py)."""

MISSING_NAMES = {
    "torchft_like.device_mesh": {
        "ManagedDeviceMesh": "ft_init_device_mesh returns a real torch DeviceMesh instead",
        "extend_device_mesh": "build the mesh with ft_init_device_mesh",
    },
}
"""torchft names torchft_like's modules lack, by module, and why."""


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """First on sys.meta_path: answers every `torchft` and `torchft.*` import."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torchft" and not fullname.startswith("torchft."):
            return None
        if fullname not in MODULES:
            why = MISSING_MODULES.get(fullname, "torchft_like has no module of that path")
            raise ModuleNotFoundError(
                f"{fullname} (torchft_like stands in for torchft): {why}; {DIFFERENCES}",
                name=fullname,
            )
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname in _PACKAGES)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(MODULES[spec.name])
        _guard_missing_names(module)
        _OWN_SPECS[spec.name] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system gave our module the alias's spec: give it its own
        # back (find_spec("torchft_like") and reload must still see it).
        assert module.__spec__ is not None
        module.__spec__ = _OWN_SPECS.pop(module.__spec__.name)


_PACKAGES = {"torchft", "torchft.checkpointing", "torchft.data"}
_OWN_SPECS: dict[str, importlib.machinery.ModuleSpec | None] = {}
_ALIAS = _Alias()


def _guard_missing_names(module: types.ModuleType) -> None:
    """Makes a torchft name `module` lacks fail naming it, at attribute access
    and at `from ... import` (an ImportError raised by the module's
    __getattr__ is what `from` passes on), or, for a name refused when
    built, import as a class whose construction fails naming it; other names
    keep the module's own __getattr__ or a plain AttributeError."""
    missing = MISSING_NAMES.get(module.__name__, {})
    refused = REFUSED_WHEN_BUILT.get(module.__name__, {})
    own: Callable[[str], Any] | None = module.__dict__.get("__getattr__")
    if not (missing or refused) or getattr(own, "_torchft_alias", False):
        return
    torchft_name = "torchft" + module.__name__.removeprefix("torchft_like")
    refusing = {
        name: _refused_class(f"{torchft_name}.{name}", why) for name, why in refused.items()
    }

    def __getattr__(name: str) -> Any:  # noqa: N807 (PEP 562's name)
        if name in refusing:
            return refusing[name]
        if name in missing:
            raise ImportError(
                f"{torchft_name}.{name} (torchft_like stands in for torchft): "
                f"{missing[name]}; {DIFFERENCES}",
                name=torchft_name,
            )
        if own is not None:
            return own(name)
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

    __getattr__._torchft_alias = True  # type: ignore[attr-defined]
    module.__getattr__ = __getattr__  # type: ignore[method-assign]


def _refused_class(torchft_name: str, why: str) -> type:
    """A class of that name whose construction raises, naming why."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        raise RuntimeError(
            f"{torchft_name} (torchft_like stands in for torchft): {why}; {DIFFERENCES}"
        )

    name = torchft_name.rsplit(".", 1)[1]
    return type(name, (), {"__init__": __init__, "__qualname__": name})


def install_as_torchft() -> None:
    """From now on `import torchft` (and every `torchft.*` path) gives
    torchft_like, even where torchft is installed. Idempotent.

    Raises:
        RuntimeError: torchft itself was imported already (its objects
            would mix with ours); call this before the first `import torchft`.
    """
    loaded = sys.modules.get("torchft")
    if loaded is not None and loaded is not sys.modules.get("torchft_like"):
        raise RuntimeError(
            f"torchft is already imported (from {getattr(loaded, '__file__', '?')}): call "
            "torchft_like.install_as_torchft() before the first `import torchft`, or set "
            "TORCHFT_LIKE_AS_TORCHFT=1 in the environment of the interpreter"
        )
    if _ALIAS not in sys.meta_path:
        sys.meta_path.insert(0, _ALIAS)
