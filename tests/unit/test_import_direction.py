"""Imports run one way: examples, bench, tests, tools -> torchft_like -> the
lighthouse client and RPC layer; private names stay inside their package; no
cycles. Read from the source with `ast`, so nothing is imported to check."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("lighthouse", "torchft_like")
GENERATED = REPO / "lighthouse" / "rpc" / "proto"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files(*roots: str) -> list[Path]:
    files = [p for root in roots for p in (REPO / root).rglob("*.py")]
    return sorted(p for p in files if GENERATED not in p.parents and ".venv" not in p.parts)


def imports(path: Path, module_level_only: bool = False) -> list[str]:
    """Every module `path` imports (`from a import b` gives a.b and a)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def is_private(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


@pytest.mark.parametrize(
    "path", python_files("torchft_like", "examples", "bench", "tests", "scripts"), ids=str
)
def test_nothing_outside_the_lighthouse_imports_its_private_names(path):
    private = [n for n in imports(path) if n.startswith("lighthouse.") and is_private(n)]
    assert not private, f"{path.relative_to(REPO)} imports lighthouse's private {private}"


@pytest.mark.parametrize("path", python_files("lighthouse"), ids=str)
def test_the_lighthouse_imports_nothing_of_the_library_or_torch(path):
    wrong = [n for n in imports(path) if n.split(".")[0] in ("torchft_like", "torch")]
    assert not wrong, f"{path.relative_to(REPO)} imports {wrong}"


@pytest.mark.parametrize("path", python_files("torchft_like"), ids=str)
def test_the_library_uses_only_the_lighthouse_client_and_rpc_layer(path):
    server_side = ("lighthouse.server", "lighthouse.cli", "lighthouse.status", "lighthouse.metrics")
    wrong = [
        n
        for n in imports(path, module_level_only=True)
        if any(n == side or n.startswith(side + ".") for side in server_side)
    ]
    assert not wrong, f"{path.relative_to(REPO)} imports the lighthouse's server side {wrong}"


@pytest.mark.parametrize("path", python_files(*PACKAGES), ids=str)
def test_the_packages_import_no_tooling(path):
    tooling = ("examples", "bench", "tests", "tools", "psutil")
    wrong = [n for n in imports(path) if n.split(".")[0] in tooling]
    assert not wrong, f"{path.relative_to(REPO)} imports {wrong}"


def test_no_module_of_the_packages_imports_itself_back_through_others():
    files = {module_name(p): p for p in python_files(*PACKAGES)}
    graph = {
        name: {n for n in imports(path, module_level_only=True) if n in files and n != name}
        for name, path in files.items()
    }
    # A package's __init__ re-exporting its own modules is not a cycle.
    for name in graph:
        graph[name] -= {n for n in graph[name] if name.startswith(n + ".")}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(trail[trail.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
