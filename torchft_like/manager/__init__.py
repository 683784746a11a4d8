"""The Manager and the rooms it is made of (torchft's `torchft.manager`).

A user imports from here: `Manager`, `WorldSizeMode`, the configuration
(`ManagerConfig`, `ManagerConfigError`) and torchft's store keys. The rooms,
one concept each (docs/architecture.md has the map):

- the rank: `rank` (the Manager's step machine), `config`, `startup`,
  `step_state`, `user_state`, `state_gate`, `training_thread`, `threads`,
  `fingerprint`, `parent_watch`, `metrics` (its data claims are
  `torchft_like.data.claims`);
- its quorum and healing: `asking` (how a rank asks), `settling` (the
  answer applied off the training thread), `heal_plan` (pure: where it
  counts, whom it heals from and serves), `healing`, `commit`, and
  `gone_watch` (its step broken when a member of the quorum is gone);
- `group/`: the group's server on group rank 0, a role of its own (its
  `__init__` has the map).

`ManagerClient` is read from this package when a Manager starts, so that
`mock.patch("torchft.manager.ManagerClient")` (torchft's tests) reaches it.
"""

from torchft_like.manager.config import ManagerConfig, ManagerConfigError, WorldSizeMode
from torchft_like.manager.group.client import ManagerClient
from torchft_like.manager.group.server import ManagerServer
from torchft_like.manager.rank import Manager
from torchft_like.manager.startup import MANAGER_ADDR_KEY, REPLICA_ID_KEY

__all__ = [
    "MANAGER_ADDR_KEY",
    "REPLICA_ID_KEY",
    "Manager",
    "ManagerClient",
    "ManagerConfig",
    "ManagerConfigError",
    "ManagerServer",
    "WorldSizeMode",
]
