"""The group's server and its client at the module path pytorch/torchft's
`_torchft` names are mapped from by the conformance shim; both live in
torchft_like.manager."""

from torchft_like.manager.client import ManagerClient
from torchft_like.manager.server import ManagerServer

__all__ = ["ManagerClient", "ManagerServer"]
