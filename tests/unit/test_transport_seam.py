"""The transport seam holds (lighthouse.rpc.call): outside the grpcio
adapter, nothing asks which server runtime it runs on, by `hasattr` on a
call or `isinstance` against a runtime's classes. Read from the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.unit.test_import_direction import REPO, python_files

ADAPTER = REPO / "lighthouse" / "rpc" / "grpcio_server.py"
CALL_NAMES = {"context", "call", "request_iterator", "requests"}
RUNTIME_CLASSES = {"LeanServer", "GrpcioServer", "GrpcioCall", "ServicerContext", "Server"}


def runtime_questions(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        if node.func.id == "hasattr" and node.args:
            subject = node.args[0]
            if isinstance(subject, ast.Name) and subject.id in CALL_NAMES:
                found.append(f"line {node.lineno}: hasattr({subject.id}, ...)")
        elif node.func.id == "isinstance" and len(node.args) == 2:
            kinds = ast.unparse(node.args[1])
            if any(name in kinds for name in RUNTIME_CLASSES):
                found.append(f"line {node.lineno}: isinstance(..., {kinds})")
    return found


@pytest.mark.parametrize("path", python_files("lighthouse", "torchft_like"), ids=str)
def test_no_module_but_the_adapter_asks_which_runtime_serves_it(path):
    if path == ADAPTER:
        return
    assert runtime_questions(path) == [], f"{path}: use lighthouse.rpc.call's one call shape"


def test_the_check_finds_what_it_looks_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def f(context, server):\n"
        "    if hasattr(context, 'park'):\n"
        "        pass\n"
        "    return isinstance(server, LeanServer)\n"
    )
    assert runtime_questions(sample) == [
        "line 2: hasattr(context, ...)",
        "line 4: isinstance(..., LeanServer)",
    ]
