"""Optimizer wrapper that ties an optimizer's step to the Manager's commit vote."""

from __future__ import annotations

from typing import Any

import torch

from torchft_like.manager import Manager


class OptimizerWrapper(torch.optim.Optimizer):
    """`zero_grad()` starts the step's quorum; `step()` steps the wrapped
    optimizer only if the group commits, so a failed step changes nothing."""

    def __init__(self, manager: Manager, optim: torch.optim.Optimizer) -> None:
        # The base __init__ is skipped on purpose: all state lives in `optim`.
        self.manager = manager
        self.optim = optim

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        assert closure is None, "closures are not supported: the step may be skipped"
        if self.manager.should_commit():
            self.optim.step()

    # The optimizer facade: code that inspects or edits an optimizer (LR
    # schedulers, param-group surgery, checkpointing) must see the wrapped
    # one, because the base class attributes were never initialised here.

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optim.defaults = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def state(self) -> Any:
        return self.optim.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optim.state = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"OptimizerWrapper({self.optim!r})"


Optimizer = OptimizerWrapper
