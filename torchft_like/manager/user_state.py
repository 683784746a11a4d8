"""The user state a Manager heals: state dict functions registered by key.

Apart from rank.py (the Manager's step machine) because it is plain bookkeeping with one rule that
matters (every registered key must be in a state loaded from a peer or a
checkpoint, or the replicas would train on different state) and an error
that says how to fix it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class UserState:
    """(load_state_dict, state_dict) functions by key, in registration order."""

    def __init__(self) -> None:
        self._fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}

    def register(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Raises ValueError if `key` is already registered."""
        if key in self._fns:
            raise ValueError(f"state dict key {key!r} is already registered")
        self._fns[key] = (load_state_dict, state_dict)

    def state_dicts(self) -> dict[str, Any]:
        """Every registered state dict, by key."""
        return {key: fns[1]() for key, fns in self._fns.items()}

    def load(self, state_dicts: dict[str, Any]) -> None:
        """Loads every registered key from `state_dicts` (keys it has beyond
        those are ignored).

        Raises:
            ValueError: a registered key is missing; nothing was loaded.
        """
        missing = sorted(set(self._fns) - set(state_dicts))
        if missing:
            raise ValueError(
                f"the state has no {missing} (registered with register_state_dict_fn; it "
                f"holds {sorted(state_dicts)}): register the same keys on every replica and "
                "as when it was saved (torchft's set_state_dict_fns names its state "
                "'set_state_dict_fns'; ours and both Manager constructors: 'default')"
            )
        for key, (load, _) in self._fns.items():
            load(state_dicts[key])
