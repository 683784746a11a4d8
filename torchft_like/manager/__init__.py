"""The Manager and the rooms it is made of (torchft's `torchft.manager`).

A user imports from here: `Manager`, `WorldSizeMode`, the configuration
(`ManagerConfig`, `ManagerConfigError`) and torchft's store keys. The rooms,
one concept each (docs/architecture.md has the map):

- the rank: `rank` (the Manager's step machine), `config`, `startup`,
  `step_state`, `user_state`, `state_gate`, `training_thread`, `threads`,
  `fingerprint`, `parent_watch`, `metrics` (its data claims are
  `torchft_like.data.claims`);
- its quorum and healing: `asking` (how a rank asks), `settling` (the
  answer applied off the training thread), `healing`, `commit`;
- the group's server on group rank 0: `server` (the quorum and vote
  gatherings), `gathering`, `quorum_gate`, `admission`, `group_request`,
  `session` (the group's session with the lighthouse), `servicer` (the
  gRPC face), `client`, `wire`.

`ManagerClient` is read from this package when a Manager starts, so that
`mock.patch("torchft.manager.ManagerClient")` (torchft's tests) reaches it.
"""

from torchft_like.manager.client import ManagerClient
from torchft_like.manager.config import ManagerConfig, ManagerConfigError, WorldSizeMode
from torchft_like.manager.rank import Manager
from torchft_like.manager.server import ManagerServer
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
