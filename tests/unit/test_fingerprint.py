"""The state fingerprint: equal exactly for bit-identical states."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchft_like.manager.fingerprint import fingerprint


def trained_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(16, 4)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def test_a_bit_identical_copy_has_the_same_fingerprint():
    state = trained_state()
    copy = {
        "model": {k: v.clone() for k, v in state["model"].items()},
        "optim": trained_state()["optim"],
    }
    assert fingerprint(state) == fingerprint(copy)
    assert len(fingerprint(state)) == 16


def test_the_order_of_mapping_keys_does_not_matter():
    state = trained_state()
    reordered = dict(state)
    reordered["optim"] = {
        "param_groups": state["optim"]["param_groups"],
        "state": dict(reversed(list(state["optim"]["state"].items()))),
    }
    assert fingerprint(state) == fingerprint(reordered)


def changed(state: dict, how: str) -> dict:
    model = {k: v.clone() for k, v in state["model"].items()}
    w = model["0.weight"]
    if how == "one weight moved by 1e-3":
        w[0, 0] += 1e-3
    elif how == "one bit of one weight flipped":
        w.view(torch.int32)[1, 1] ^= 1
    elif how == "two weights swapped":
        w[0, 0], w[0, 1] = w[0, 1].clone(), w[0, 0].clone()
    elif how == "a buffer changed":
        model["1.running_mean"][0] += 1
    elif how == "a tensor reshaped":
        model["0.weight"] = w.reshape(4, 8)
    elif how == "a tensor of another dtype":
        model["0.weight"] = w.double()
    return {"model": model, "optim": state["optim"]}


@pytest.mark.parametrize(
    "how",
    [
        "one weight moved by 1e-3",
        "one bit of one weight flipped",
        "two weights swapped",
        "a buffer changed",
        "a tensor reshaped",
        "a tensor of another dtype",
    ],
)
def test_any_change_gives_another_fingerprint(how):
    state = trained_state()
    assert fingerprint(changed(state, how)) != fingerprint(state)


def test_a_change_of_the_optimizer_state_gives_another_fingerprint():
    state = trained_state()
    other = trained_state()
    other["optim"]["state"][0]["exp_avg"][0, 0] += 1e-3
    assert fingerprint(other) != fingerprint(state)


def test_a_changed_hyperparameter_gives_another_fingerprint():
    state, other = trained_state(), trained_state()
    other["optim"]["param_groups"][0]["lr"] = 0.02
    assert fingerprint(other) != fingerprint(state)


def test_parameters_from_a_generator_and_unusual_dtypes_are_fingerprinted():
    model = nn.Linear(3, 3).to(torch.bfloat16)
    first = fingerprint(model.parameters())
    assert first == fingerprint(list(model.parameters()))
    with torch.no_grad():
        model.bias[0] += 1
    assert fingerprint(model.parameters()) != first
    assert fingerprint({"flag": torch.tensor([True, False]), "scalar": torch.tensor(3)})
