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


def is_type_checking_block(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): imports that never run."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def run_time_nodes(tree: ast.Module) -> list[ast.AST]:
    """Every node of `tree` but those under `if TYPE_CHECKING:`."""
    found: list[ast.AST] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        if is_type_checking_block(node):
            assert isinstance(node, ast.If)
            todo += node.orelse
        else:
            todo += ast.iter_child_nodes(node)
    return found


def imports(path: Path, module_level_only: bool = False, run_time_only: bool = False) -> list[str]:
    """Every module `path` imports (`from a import b` gives a.b and a).

    module_level_only: only the imports that run when it is imported.
    run_time_only: all but those under `if TYPE_CHECKING:`, which never run.
    """
    tree = ast.parse(path.read_text(), str(path))
    if module_level_only:
        nodes: list[ast.AST] = list(tree.body)
    elif run_time_only:
        nodes = run_time_nodes(tree)
    else:
        nodes = list(ast.walk(tree))
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
    server_side = (
        "lighthouse.shell.server",
        "lighthouse.cli",
        "lighthouse.status.server",
        "lighthouse.shell.metrics",
    )
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


@pytest.mark.parametrize("counted", ["at_import", "lazy", "typing"])
def test_no_module_of_the_packages_imports_itself_back_through_others(counted):
    """No cycle among the imports that run at import time, nor once the
    imports inside functions (a lazy re-export, a deferred heavy import) are
    counted too: a lazy import back is a cycle that waits for its first call;
    nor with the imports for type checking: a cycle hidden as a type-only
    import hides a reach into the other module's insides.
    A package's __init__ and its modules are distinct nodes, as Python loads
    them: `torchft_like.process_group` re-exports `ft_init_device_mesh`
    lazily, and device_mesh imports `torchft_like.process_group.managed`."""
    files = {module_name(p): p for p in python_files(*PACKAGES)}
    graph = {
        name: {
            n
            for n in imports(
                path,
                module_level_only=counted == "at_import",
                run_time_only=counted == "lazy",
            )
            if n in files and n != name
        }
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


THIRD_PARTY_PRIVATE = frozenset(
    (
        "_exit",  # os._exit: a process that must end now, without cleanup
        "_replace",  # a namedtuple's public method, spelled private
        "_world",  # torch.distributed.distributed_c10d: how torch registers process groups
        "_register_process_group",
        "_unregister_process_group",
        "_register_comm_hook",  # torch's DDP comm hook, as torch's own DDP registers it
        "_remove_autograd_hooks",
        "_set_static_graph",
        "_Options",  # torch's ProcessGroupGloo options: timeout and devices
        "_timeout",
        "_devices",
        "_set_sequence_number_for_group",  # a new c10d backend's collective numbering
        "_load",  # torch.serialization._load: a stream torch.load cannot take
        "_torchft_alias",  # a marker this project sets on its own function
    )
)
"""Private names of other libraries the packages must use, and why."""


def own_private_names(tree: ast.Module) -> set[str]:
    """The `_names` a module defines: its functions, classes, attributes
    assigned anywhere in it (`self._x = ...`), and module-level names."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_")}


@pytest.mark.parametrize("path", python_files(*PACKAGES), ids=str)
def test_no_module_reads_another_modules_private_members(path):
    """`obj._name` for a `_name` this module does not define reaches into
    another module's insides; give the thing a public shape instead."""
    tree = ast.parse(path.read_text(), str(path))
    own = own_private_names(tree)
    reaches = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") or node.attr in own or node.attr in THIRD_PARTY_PRIVATE:
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            continue  # its own class's, or a base class's
        reaches.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not reaches, f"{path.relative_to(REPO)} reads private members: {reaches}"


PRIVATE_IMPORTS_LEFT = {
    # The conformance shim (shared/) imports it by this name; torchft's
    # ProcessGroupWrapper, kept out of star-imports.
    ("torchft_like/process_group/__init__.py", "_ProcessGroupWrapper"),
}
"""`from x import _name` across modules still in the tree, each named."""


@pytest.mark.parametrize("path", python_files(*PACKAGES), ids=str)
def test_no_module_imports_another_modules_private_names(path):
    """`from x import _name` of our own packages reaches into x's insides
    as surely as `x._name`: give the name a public shape."""
    tree = ast.parse(path.read_text(), str(path))
    where = str(path.relative_to(REPO))
    found = [
        f"line {node.lineno}: from {node.module} import {alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
        and node.module.split(".")[0] in PACKAGES
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
        and (where, alias.name) not in PRIVATE_IMPORTS_LEFT
    ]  # fmt: skip
    assert not found, f"{where} imports private names: {found}"


def module_edges(path: Path, files: dict[str, Path]) -> set[str]:
    """The modules of `files` that `path` imports, anywhere in it. `from pkg
    import mod` is an edge to pkg.mod alone: the package's __init__ runs for
    any of its modules, so counting it would make every module import its
    package's re-exports."""
    edges: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            edges |= submodules if submodules <= files.keys() else {node.module}
    return {e for e in edges if e in files}


FOLDER_LOOPS_ALLOWED: dict[tuple[str, str], str] = {}
"""(folder, module outside it) pairs whose way back into the folder is
accepted, and why; none today."""


@pytest.mark.parametrize("folder", ["torchft_like.manager"])
def test_nothing_a_folder_imports_imports_the_folder_back(folder):
    """A loop at folder level: a module outside `folder` that the folder's
    modules import (directly or through others outside it) imports the
    folder back, so neither can be read, tested or moved without the other.
    torchft_like.gone_watch, which imports manager.config, was one before it
    moved into manager/."""
    files = {module_name(p): p for p in python_files(*PACKAGES)}
    graph = {name: module_edges(path, files) for name, path in files.items()}

    def inside(name: str) -> bool:
        return name == folder or name.startswith(folder + ".")

    outside_used = {n for name in files if inside(name) for n in graph[name] if not inside(n)}
    loops = []
    for start in sorted(outside_used):
        trail = {start: start}
        todo = [start]
        while todo:
            node = todo.pop()
            for nxt in sorted(graph[node]):
                if inside(nxt) and (folder, start) not in FOLDER_LOOPS_ALLOWED:
                    loops.append(f"{trail[node]} -> {nxt}")
                elif not inside(nxt) and nxt not in trail:
                    trail[nxt] = f"{trail[node]} -> {nxt}"
                    todo.append(nxt)
    assert not loops, f"{folder} imports modules that import it back: " + "; ".join(loops)


MAX_OWN_MODULES = 15
"""Modules a folder holds of its own when it has no subpackages."""
MAX_OWN_MODULES_LAYERED = 20
"""... and when subpackages name its layers (each with a map in its __init__)."""
WAITING_FOR_MOVES: set[str] = set()
"""Folders over the limit whose moves into subpackages are under way (paths
relative to the repository); each is checked to be still over it."""


def package_dirs() -> list[Path]:
    dirs = {p.parent for p in python_files(*PACKAGES) if "__pycache__" not in p.parts}
    return sorted(dirs)


@pytest.mark.parametrize("folder", package_dirs(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_folder_holds_too_many_modules_of_its_own(folder):
    """A reader finds a module by the folder's layers, not in a flat list:
    15 modules of its own at most, 20 with subpackages that name its layers."""
    own = sorted(p.name for p in folder.glob("*.py"))
    layers = [d.name for d in folder.iterdir() if (d / "__init__.py").is_file()]
    limit = MAX_OWN_MODULES_LAYERED if layers else MAX_OWN_MODULES
    where = str(folder.relative_to(REPO))
    if where in WAITING_FOR_MOVES:
        assert len(own) > limit, f"{where} holds {len(own)}: take it out of WAITING_FOR_MOVES"
        return
    assert len(own) <= limit, (
        f"{where} holds {len(own)} modules of its own (at most {limit} "
        f"{'with' if layers else 'without'} subpackages): {own}"
    )
