"""The lighthouse: the job-wide coordinator that forms a quorum each step.

It never imports torch, so it starts fast and runs on a small machine.
"""

from lighthouse.client import LighthouseClient
from lighthouse.errors import LighthouseUnavailableError, QuorumError, QuorumTimeoutError
from lighthouse.quorum import LighthouseConfig, Quorum, QuorumMember
from lighthouse.server import LighthouseServer

__all__ = [
    "LighthouseClient",
    "LighthouseConfig",
    "LighthouseServer",
    "LighthouseUnavailableError",
    "Quorum",
    "QuorumError",
    "QuorumMember",
    "QuorumTimeoutError",
]
