"""The library's layering: torchft_like/ and lighthouse/ never import psutil or tools/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIBRARY_PACKAGES = ("torchft_like", "lighthouse")
FORBIDDEN = {
    "psutil": "a dependency of the tooling (dev and demo extras), not of a training job",
    "tools": "repository tooling, not installed with the library",
}


def absolute_imports(source: str) -> set[str]:
    """Top-level names of the modules `source` imports; relative imports are its own."""
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def library_modules() -> list[Path]:
    return sorted(path for pkg in LIBRARY_PACKAGES for path in (REPO / pkg).rglob("*.py"))


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import psutil", {"psutil"}),
        ("import os, psutil.tests as t", {"os", "psutil"}),
        ("from tools.procs import kill_tree", {"tools"}),
        ("def f():\n    from tools import chaos", {"tools"}),
        ("from . import tools\nfrom .tools import x", set()),
    ],
)
def test_absolute_imports_finds_every_imported_top_level_module(source, expected):
    assert absolute_imports(source) == expected


def test_the_library_imports_neither_psutil_nor_the_repository_tools():
    modules = library_modules()
    assert len(modules) > 20, f"found only {len(modules)} library modules under {REPO}"
    offenders = [
        f"{path.relative_to(REPO)} imports {name}: {FORBIDDEN[name]}"
        for path in modules
        for name in sorted(absolute_imports(path.read_text()) & FORBIDDEN.keys())
    ]
    assert not offenders, "\n".join(offenders)
