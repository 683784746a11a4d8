"""The lighthouse: the job-wide coordinator that forms a quorum each step.

It never imports torch, so it starts fast and runs on a small machine.
"""

from importlib import metadata as _metadata
from typing import Any

from lighthouse.client import LighthouseClient
from lighthouse.core.quorum import LighthouseConfig, Quorum, QuorumMember
from lighthouse.rpc.errors import (
    DuplicateGroupError,
    FreshStartRefusedError,
    IncompatibleGroupError,
    LighthouseUnavailableError,
    QuorumError,
    QuorumTimeoutError,
)

try:
    # The distribution that ships both packages, torchft_like and lighthouse.
    __version__ = _metadata.version("torchft-like")
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "DuplicateGroupError",
    "FreshStartRefusedError",
    "IncompatibleGroupError",
    "LighthouseClient",
    "LighthouseConfig",
    "LighthouseServer",
    "LighthouseUnavailableError",
    "Quorum",
    "QuorumError",
    "QuorumMember",
    "QuorumTimeoutError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # The server loads on first use: every training worker imports this
    # package for the client, and the server's Prometheus metrics and status
    # page cost each worker start 50-200 ms it never needs.
    if name == "LighthouseServer":
        from lighthouse.shell.server import LighthouseServer

        return LighthouseServer
    raise AttributeError(f"module 'lighthouse' has no attribute {name!r}")
