"""Regenerates the committed gRPC stubs in lighthouse/rpc/proto from proto/.

Usage: python scripts/gen_proto.py [OUT_ROOT]

OUT_ROOT defaults to the repository root; the stale-stub test passes a
temporary folder and compares. The proto is mapped to the package path
lighthouse/rpc/proto, so the generated imports are package-absolute
(`from lighthouse.rpc.proto import torchft_pb2`).
"""

import sys
from pathlib import Path

from grpc_tools import protoc

REPO = Path(__file__).resolve().parent.parent


def generate(out_root: Path) -> None:
    out_root.mkdir(parents=True, exist_ok=True)
    (out_root / "lighthouse" / "rpc" / "proto").mkdir(parents=True, exist_ok=True)
    builtin_protos = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-Ilighthouse/rpc/proto={REPO / 'proto'}",
        f"-I{builtin_protos}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        "lighthouse/rpc/proto/torchft.proto",
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the message above")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
