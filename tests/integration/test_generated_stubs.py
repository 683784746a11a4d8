"""The committed gRPC stubs are exactly what the pinned generator produces."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STUBS = ["torchft_pb2.py", "torchft_pb2.pyi", "torchft_pb2_grpc.py"]


@pytest.mark.timeout(60)
def test_committed_stubs_match_a_fresh_generation(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools comes with the dev extra")
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_proto.py"), str(tmp_path)], check=True
    )
    for name in STUBS:
        fresh = (tmp_path / "lighthouse" / "rpc" / "proto" / name).read_bytes()
        committed = (REPO / "lighthouse" / "rpc" / "proto" / name).read_bytes()
        assert fresh == committed, (
            f"lighthouse/rpc/proto/{name} is stale: run python scripts/gen_proto.py"
        )
