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

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"OptimizerWrapper({self.optim!r})"


Optimizer = OptimizerWrapper
