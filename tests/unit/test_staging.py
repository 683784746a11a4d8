"""Where received and restored checkpoint tensors go, and the host ring that
stages CUDA bytes, checked on the CPU (the ring with pinning off and no
stream runs the same slicing and ordering code as on a GPU)."""

from __future__ import annotations

import pickle

import pytest
import torch

from torchft_like.checkpointing import durable, staging, state_format
from torchft_like.checkpointing.pg_transport import backend_name, wire_device


def _bytes(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 64, 1000])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_ring_reads_every_byte_in_order_in_slices(n: int, depth: int) -> None:
    ring = staging.HostRing(torch.device("cpu"), slice_bytes=8, depth=depth, pin=False)
    flat = _bytes(n + 5)
    views = [bytes(v) for v in ring.read(flat, 3, 3 + n)]
    assert b"".join(views) == bytes(state_format.memview(flat[3 : 3 + n]))
    assert all(len(v) == 8 for v in views[:-1]) and all(0 < len(v) <= 8 for v in views)
    assert not ring.pinned


def test_a_reader_that_stops_early_leaves_the_ring_usable() -> None:
    ring = staging.HostRing(torch.device("cpu"), slice_bytes=4, depth=2, pin=False)
    flat = _bytes(40)
    reader = ring.read(flat, 0, 40)
    next(reader)
    reader.close()
    assert b"".join(bytes(v) for v in ring.read(flat, 0, 40)) == bytes(state_format.memview(flat))


@pytest.mark.parametrize("n", [0, 5, 16, 17, 100])
def test_the_ring_writes_every_byte(n: int) -> None:
    ring = staging.HostRing(torch.device("cpu"), slice_bytes=16, depth=2, pin=False)
    source, dst = _bytes(n), torch.zeros(n, dtype=torch.uint8)
    ring.write(dst, source)
    ring.finish()
    assert torch.equal(dst, source)
    with pytest.raises(ValueError, match="bytes to write into"):
        ring.write(torch.zeros(n + 1, dtype=torch.uint8), source)


def test_the_ring_refuses_empty_buffers() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        staging.HostRing(torch.device("cpu"), slice_bytes=0, pin=False)


def test_cpu_leaves_stay_and_cuda_leaves_go_to_the_named_device() -> None:
    assert staging.target_device("cpu", torch.device("cuda", 2)) == torch.device("cpu")
    assert staging.target_device("cuda:0", torch.device("cuda", 2)) == torch.device("cuda", 2)
    assert staging.target_device("cuda:1", torch.device("cpu")) == torch.device("cpu")


def test_without_cuda_cuda_leaves_land_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert staging.home_cuda_device() is None
    assert staging.target_device("cuda:3", None) == torch.device("cpu")
    assert staging.resolve_device(None) is None
    assert staging.resolve_device("cpu") == torch.device("cpu")


def test_the_home_gpu_follows_local_rank_not_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert staging.home_cuda_device() == torch.device("cuda", 1)
    assert staging.target_device("cuda:0", None) == torch.device("cuda", 1)


def test_placing_cpu_leaves_copies_nothing() -> None:
    tensors = [torch.ones(3), torch.zeros(2, dtype=torch.int64)]
    specs = [state_format.TensorSpec(t.dtype, tuple(t.shape), t.nbytes, "cpu") for t in tensors]
    placed = staging.place(specs, tensors, None)
    assert all(a is b for a, b in zip(placed, tensors))


def test_record_ready_makes_no_cuda_call_for_cpu_tensors() -> None:
    assert staging.record_ready([torch.ones(2)]) == {}


def test_a_durable_ref_of_an_older_checkpoint_reads_as_cpu() -> None:
    ref = pickle.loads(pickle.dumps(durable._Ref(3)))
    old = durable._Ref.__new__(durable._Ref)
    old.__dict__.update({"index": 3})  # as a checkpoint written before devices were saved
    assert ref.device == "cpu" and pickle.loads(pickle.dumps(old)).device == "cpu"


def test_a_state_saved_from_a_gpu_restores_on_the_cpu_without_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    tensors = {"t0": torch.ones(2)}
    out = durable._join({"w": durable._Ref(0, "cuda:1")}, tensors)
    assert out["w"] is tensors["t0"]


class _Named:
    def __init__(self, name: str) -> None:
        self._name = name

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return self._name


def test_pg_transport_sends_over_host_memory_unless_the_group_is_nccl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert wire_device(_Named("torchft-gloo"), torch.device("cuda", 0)) == torch.device("cpu")
    assert wire_device(object(), None) == torch.device("cpu")
    assert backend_name(object()) == ""
    assert wire_device(_Named("torchft-nccl"), torch.device("cuda", 1)) == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="NCCL needs a CUDA GPU"):
        wire_device(_Named("nccl"), torch.device("cpu"))
