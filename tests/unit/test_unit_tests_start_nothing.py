"""tests/unit runs no server, no subprocess and opens no socket: those tests
live in tests/integration. Read from the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent

FORBIDDEN_MODULES = (
    "subprocess",
    "socket",
    "multiprocessing",
    "http.server",
    "socketserver",
    "tests.procs",
    "lighthouse.rpc.serve",
)
"""Modules whose import means a process, a socket or a serving loop."""
FORBIDDEN_NAMES = frozenset(
    ("LighthouseServer", "ManagerServer", "HTTPTransport", "BackgroundLoop", "TCPStore")
)
"""Servers, by the names a test would import or reach through a module."""


def reaches(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
            found += [a.name for a in node.names if a.name in FORBIDDEN_NAMES]
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_NAMES:
            found.append(node.attr)
            continue
        else:
            continue
        found += [m for m in modules if m.startswith(FORBIDDEN_MODULES)]
    return found


@pytest.mark.parametrize("path", sorted(UNIT.glob("test_*.py")), ids=lambda p: p.name)
def test_a_unit_test_starts_no_server_process_or_socket(path):
    assert not reaches(path), f"{path.name} reaches {reaches(path)}: move it to tests/integration"
