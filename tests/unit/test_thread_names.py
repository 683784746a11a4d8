"""Every thread the project starts is named `<package>_<what>`: `torchft_`
in torchft_like, `lighthouse_` in the lighthouse (docs/architecture.md,
"Threads"): a stack dump, a profile or a test finds a thread by its name.
Read from the source with `ast`, as test_import_direction does."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCHEMES = {
    "torchft_like": re.compile(r"torchft_[a-z0-9_]+"),
    "lighthouse": re.compile(r"lighthouse_[a-z0-9_]+"),
}
"""Each package's scheme, by its folder."""

NAMED_BY = {
    "Thread": "name",
    "ThreadPoolExecutor": "thread_name_prefix",
    "BackgroundLoop": 0,  # lighthouse.loop: the loop thread's name
    "Watchdog": 0,  # process_group.watchdog: its thread's name
}
"""The calls that start a thread, and the argument (keyword or position) naming it."""

PASSED_ON = {
    ("torchft_like/process_group/watchdog.py", "self._name"): "Watchdog's first argument",
    ("torchft_like/manager/gone_watch.py", "name"): "built as torchft_{what} just above",
    ("lighthouse/loop.py", "name"): "BackgroundLoop's first argument",
}
"""Names not written at the call: where they come from."""


def called(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def spelled(node: ast.expr | None) -> str | None:
    """A literal name, or an f-string's leading literal part."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
    return None


def thread_names(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, call, how its name is spelled) of each thread `path` starts;
    the spelling is the source text when the name is not a literal, None
    when the thread gets no name."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or called(node) not in (*NAMED_BY, "Timer"):
            continue
        call = called(node)
        if call == "Timer":  # takes no name: one is assigned to the timer after
            found.append((node.lineno, call, timer_name(tree, node)))
            continue
        how = NAMED_BY[call]
        arg = (
            next((k.value for k in node.keywords if k.arg == how), None)
            if isinstance(how, str)
            else (node.args[how] if len(node.args) > how else None)
        )
        text = spelled(arg)
        found.append(
            (node.lineno, call, text if text is not None or arg is None else ast.unparse(arg))
        )
    return found


def timer_name(tree: ast.Module, timer: ast.Call) -> str | None:
    """The name assigned to `timer` (`t = threading.Timer(...)`, then `t.name = "..."`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and node.value is timer:
            held = ast.unparse(node.targets[0])
            for other in ast.walk(tree):
                if (
                    isinstance(other, ast.Assign)
                    and isinstance(other.targets[0], ast.Attribute)
                    and other.targets[0].attr == "name"
                    and ast.unparse(other.targets[0].value) == held
                ):
                    return spelled(other.value)
    return None


def package_files() -> list[Path]:
    return sorted(p for package in SCHEMES for p in (REPO / package).rglob("*.py"))


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_thread_the_project_starts_is_named_by_its_packages_scheme(path):
    where = str(path.relative_to(REPO))
    package = where.split("/")[0]
    wrong = []
    for line, call, name in thread_names(path):
        if name is None:
            wrong.append(f"line {line}: {call} without a name")
        elif (where, name) in PASSED_ON:
            continue
        elif not SCHEMES[package].match(name):
            wrong.append(f"line {line}: {call} named {name!r}")
    assert not wrong, f"{where}: threads not named {package}'s way: {wrong}"


def test_the_check_finds_unnamed_and_misnamed_threads(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import threading\n"
        "threading.Thread(target=print).start()\n"
        "threading.Thread(target=print, name='checkpoint-http').start()\n"
    )
    assert thread_names(sample) == [(2, "Thread", None), (3, "Thread", "checkpoint-http")]
