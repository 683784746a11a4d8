"""Low-level coordination pieces under torchft's names: the lighthouse and the
manager servers and clients, for users who build their own loop."""

from typing import Any

from lighthouse import LighthouseClient
from torchft_like.manager.group.client import ManagerClient
from torchft_like.manager.group.server import ManagerServer

__all__ = ["LighthouseClient", "LighthouseServer", "ManagerClient", "ManagerServer"]  # noqa: F822


def __getattr__(name: str) -> Any:
    # The library itself never runs a lighthouse; this name is here because
    # torchft's coordination module has it, and loads only when asked for.
    if name == "LighthouseServer":
        from lighthouse import LighthouseServer

        return LighthouseServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
