"""Low-level coordination pieces: the lighthouse and the manager servers and clients."""

from lighthouse import LighthouseClient, LighthouseServer
from torchft_like.manager_server import ManagerClient, ManagerServer

__all__ = ["LighthouseClient", "LighthouseServer", "ManagerClient", "ManagerServer"]
