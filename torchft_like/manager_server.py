"""The group's server and its client at the module path pytorch/torchft's
`_torchft` names are mapped from by the conformance shim; both live in
torchft_like.manager.group."""

from torchft_like.manager.group.client import ManagerClient
from torchft_like.manager.group.server import ManagerServer

__all__ = ["ManagerClient", "ManagerServer"]
