"""DTensor state over HTTPTransport: real DTensors on real gloo groups.

Two ranks of one gloo world each shard a tensor over a 1-D mesh. Each rank
serves its state and fetches it back over HTTP (rank r of a healing group
takes rank r's shard); the received DTensor has the same spec and shard, and
a collective on it (full_tensor) works on the rebuilt mesh, and its state
fingerprint is the sender's.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tools.procs import free_port
from torchft_like.checkpointing import HTTPTransport, state_format
from torchft_like.manager.fingerprint import fingerprint

pytestmark = pytest.mark.timeout(60)
T = timedelta(seconds=10)


def rank_main(rank: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=T
    )
    mesh = DeviceMesh("cpu", [0, 1], mesh_dim_names=("fsdp",))
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    state = {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "b": distribute_tensor(torch.ones(3), mesh, [Replicate()]),
        "plain": torch.tensor([rank]),
        "step": 7,
    }
    source = HTTPTransport(timeout=T, hostname="127.0.0.1")
    receiver = HTTPTransport(timeout=T, hostname="127.0.0.1")
    try:
        source.send_checkpoint([1], 7, state, T)
        got = receiver.recv_checkpoint(0, source.metadata(), 7, T)
    finally:
        source.shutdown()
        receiver.shutdown()
    for key in ("w", "b"):
        assert isinstance(got[key], DTensor), type(got[key])
        assert got[key]._spec == state[key]._spec, (got[key]._spec, state[key]._spec)
        assert torch.equal(got[key].to_local(), state[key].to_local())
    assert got["w"].to_local().shape == (3, 4)
    assert torch.equal(got["w"].full_tensor(), full)  # a gloo collective on the rebuilt mesh
    assert torch.equal(got["plain"], state["plain"]) and got["step"] == 7
    # Divergence checks read FSDP state too: this rank's shard, as received.
    assert fingerprint(got) == fingerprint(state)
    assert fingerprint({"w": got["w"]}) != fingerprint({"w": got["b"]})
    dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)


def test_sharded_dtensors_round_trip_and_work_on_the_receivers_mesh(children, tmp_path):
    port = free_port()
    ranks = [
        children.spawn(
            [sys.executable, "-m", "tests.integration.test_dtensor_state", str(r), str(port)],
            log=tmp_path / f"rank{r}.log",
        )
        for r in range(2)
    ]
    for r, proc in enumerate(ranks):
        assert proc.wait(timeout=50) == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
        assert f"rank {r} ok" in (tmp_path / f"rank{r}.log").read_text()


def test_a_dtensor_node_with_a_bad_placement_is_refused_before_any_data():
    node = {
        "dtensor": {
            "local": {"tensor": {"dtype": "float32", "shape": [2], "nbytes": 8, "device": "cpu"}},
            "device_type": "cpu",
            "mesh": [0, 1],
            "dim_names": None,
            "placements": [{"shard": "x"}],
            "shape": [4],
            "stride": [1],
        }
    }
    header = state_format.encode_header(1, {"dict": [["w", node]]}, "crc32c")
    with pytest.raises(ValueError, match=r"state\['w'\]: unknown placement"):
        state_format.decode_header(header[state_format.PREFIX.size :])


def test_other_tensor_subclasses_fail_in_send_naming_their_path():
    class Tagged(torch.Tensor):
        pass

    with pytest.raises(TypeError, match=r"state\['t'\]: tensor subclass Tagged cannot be sent"):
        state_format.flatten({"t": torch.ones(2).as_subclass(Tagged)})


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)  # skip finalization, where gloo's threads can abort a finished process
