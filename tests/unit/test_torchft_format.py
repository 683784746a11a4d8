"""torchft's checkpoint payload (torch's streaming save format) as we write
and read it: bit-exact, decoded weights_only, refused when cut or unsafe."""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict

import pytest
import torch

from torchft_like.checkpointing import torchft_http as tf

RAN: list[str] = []


def record(what: str) -> str:
    RAN.append(what)
    return what


class Sneaky:
    """Unpickling it with an unrestricted unpickler would call `record`."""

    def __reduce__(self):
        return record, ("arbitrary code ran",)


def healing_state() -> dict:
    """What a Manager sends: user state dicts and the manager's progress."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    return {
        "user": {
            "default": {"m": model.state_dict(), "o": adamw_state(model)},
            "extra": {
                "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
                "empty": torch.empty(0, 2),
                "view": torch.arange(10.0)[2:8:2],
                "mixed": [1, 2.5, "s", None, True, (3, "t")],
            },
        },
        "torchft": {"step": 7, "batches_committed": 14},
    }


def adamw_state(model: torch.nn.Module) -> dict:
    """An AdamW state dict after some steps, built directly (a first real
    optimizer step costs seconds of lazy imports)."""
    params = list(model.parameters())
    return {
        "state": {
            i: {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(p),
                "exp_avg_sq": torch.rand_like(p)}
            for i, p in enumerate(params)
        },
        "param_groups": [
            {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0.01,
             "amsgrad": False, "foreach": None, "params": list(range(len(params)))}
        ],
    }  # fmt: skip


def encoded(state: object) -> bytes:
    out = io.BytesIO()
    tf.encode(state, out)
    return out.getvalue()


def assert_identical(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for key in a:
            assert_identical(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_identical(x, y)
    else:
        assert type(a) is type(b) and a == b


def test_a_healing_state_round_trips_bit_exactly_with_its_container_types():
    state = healing_state()
    got = tf.decode(io.BytesIO(encoded(state)), "peer")
    assert_identical(state, got)
    assert isinstance(got["user"]["default"]["m"], OrderedDict)


def test_torch_save_zip_from_a_torch_without_streaming_save_is_read_too():
    state = healing_state()
    out = io.BytesIO()
    torch.save(state, out)
    assert_identical(state, tf.decode(io.BytesIO(out.getvalue()), "peer"))


@pytest.mark.parametrize("streaming", [True, False])
def test_an_object_that_needs_unpickling_is_refused_naming_peer_and_global(streaming):
    out = io.BytesIO()
    state = {"user": {"default": {"w": torch.ones(2), "sched": Sneaky()}}}
    if streaming:
        tf.encode(state, out)
    else:
        torch.save(state, out)
    with pytest.raises(tf.UnsafeStateError) as e:
        tf.decode(io.BytesIO(out.getvalue()), "step 3 from torchft replica rank 0 (key 'full')")
    text = str(e.value)
    assert "step 3 from torchft replica rank 0 (key 'full')" in text
    assert f"{__name__}.record" in text and "weights_only" in text
    assert RAN == []  # refused before anything of it ran
    assert isinstance(e.value, ValueError)


def test_a_body_cut_short_is_refused_and_never_loaded():
    body = encoded(healing_state())
    for cut in (len(body) - 1, len(body) - 40, len(body) // 2):
        with pytest.raises(ConnectionError, match="ended early"):
            tf.decode(io.BytesIO(body[:cut]), "peer")
    for cut in (0, 1, 10):  # inside the record list
        with pytest.raises((ConnectionError, ValueError)):
            tf.decode(io.BytesIO(body[:cut]), "peer")


def test_bytes_after_the_last_record_or_garbage_are_not_a_state():
    body = encoded({"w": torch.ones(3)})
    with pytest.raises(ValueError, match="follow the last record"):
        tf.decode(io.BytesIO(body + b"x"), "peer")
    with pytest.raises(ValueError):
        tf.decode(io.BytesIO(b"\x80\x02garbage that is no pickle"), "peer")
    with pytest.raises(ValueError):
        tf.decode(io.BytesIO(b"PK\x03\x04 not a zip"), "peer")


def test_a_storage_of_another_size_than_the_pickle_names_is_refused():
    from torch.distributed._serialization import _PseudoZipFile
    from torch.serialization import _save

    records = _PseudoZipFile()
    _save({"w": torch.ones(4)}, records, pickle, 2, False)
    [key] = [k for k, (d, _) in records.records.items() if isinstance(d, torch.UntypedStorage)]
    records.records[key] = (torch.UntypedStorage(8), 8)  # 8 bytes where the pickle says 16
    out = io.BytesIO()
    records.write_to(out)
    with pytest.raises(ValueError, match="has 8 bytes, the pickle says 16"):
        tf.decode(io.BytesIO(out.getvalue()), "peer")


def test_a_state_already_on_the_cpu_is_served_without_a_copy():
    state = {"w": torch.ones(2), "n": [torch.zeros(1)]}
    assert tf.on_cpu(state) is state
