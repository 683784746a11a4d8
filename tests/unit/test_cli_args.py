"""Command-line mistakes end in one line naming the flag, never a traceback, and a
misspelled flag is refused, never taken as a prefix of another."""

from __future__ import annotations

import ast
import importlib.util
import io
from importlib import metadata
from pathlib import Path

import pytest

import lighthouse
from lighthouse import cli

REPO = Path(__file__).resolve().parents[2]


def _load_demo():
    spec = importlib.util.spec_from_file_location("_demo_under_test", REPO / "examples/demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


demo = _load_demo()


def _one_line_error(capsys, parse, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--min-replicas", "1", "--log-level", "LOUD"],
         "argument --log-level: invalid choice: 'LOUD'"),
        (["--min-replica", "1"], "the following arguments are required: --min-replicas"),
        (["--min-replicas", "1", "--heartbeat-timeout", "5"],
         "unrecognized arguments: --heartbeat-timeout"),
        (["--min-replicas", "one"], "argument --min-replicas/--min_replicas: invalid int value"),
    ],
)  # fmt: skip
def test_a_lighthouse_flag_mistake_is_one_line_naming_it(capsys, argv, message):
    err = _one_line_error(capsys, cli.build_parser().parse_args, argv)
    assert err.startswith("torchft-lighthouse: error: "), err
    assert message in err
    assert "(--help lists every option)" in err


def test_the_lighthouse_log_level_is_taken_in_any_case():
    args = cli.build_parser().parse_args(["--min-replicas", "1", "--log-level", "debug"])
    assert args.log_level == "DEBUG"


def test_lighthouse_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"torchft-lighthouse {lighthouse.__version__}\n"
    assert lighthouse.__version__ == metadata.version("torchft-like")


def test_both_packages_carry_the_distributions_version_and_are_typed():
    import torchft_like

    assert torchft_like.__version__ == lighthouse.__version__ == metadata.version("torchft-like")
    assert "__version__" in torchft_like.__all__ and "__version__" in lighthouse.__all__
    for package in (torchft_like, lighthouse):
        assert (Path(package.__file__).parent / "py.typed").is_file()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--groups", "0"], "--groups (0) must be at least 1"),
        (["--nproc-per-group", "0"], "--nproc-per-group (0) must be at least 1"),
        (["--steps", "0"], "--steps (0) must be at least 1"),
        (["--groups", "1"], "--victim (1) must name one of the replica groups, 0 to 0"),
        (["--victim", "-1"], "--victim (-1) must name one of the replica groups"),
        (["--steps", "10", "--kill-at-step", "10"], "--kill-at-step (10) must be below --steps"),
        (["--restart-after", "-1"], "--restart-after (-1.0) must not be negative"),
        (["--timeout", "0"], "--timeout (0.0) must be positive"),
        (["--step", "3"], "unrecognized arguments: --step 3"),
        (["--groups", "two"], "argument --groups: invalid int value: 'two'"),
    ],
)
def test_a_demo_flag_mistake_is_one_line_naming_it(capsys, argv, message):
    err = _one_line_error(capsys, demo.parse_args, argv)
    assert err.startswith(f"{demo.parser.prog}: error: "), err
    assert message in err


@pytest.mark.parametrize(
    "argv, steps, kill_at",
    [
        ([], 400, 133),
        (["--example", "diloco"], 30, 10),
        (["--steps", "9", "--kill-at-step", "0"], 9, 0),
    ],
)
def test_the_demo_fills_in_steps_and_the_kill_step(argv, steps, kill_at):
    args = demo.parse_args(argv)
    assert (args.steps, args.kill_at_step) == (steps, kill_at)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_piped_to_a_file_prints_a_line_every_few_seconds_and_on_a_new_note():
    out = io.StringIO()
    progress = demo.Progress(out, every_s=5.0)
    restarting = "killed, restarting"
    updates = [(0.0, 1, ""), (1.0, 2, ""), (4.9, 3, ""), (5.0, 4, ""),
               (5.1, 5, restarting), (6.0, 6, restarting)]  # fmt: skip
    for now, done, note in updates:
        progress.update(done, 10, note, now)
    progress.end()
    assert out.getvalue().splitlines() == [
        "progress: 1/10 steps",
        "progress: 4/10 steps",
        "progress: 5/10 steps  killed, restarting",
    ]
    assert "\r" not in out.getvalue()


def test_progress_on_a_terminal_redraws_one_bar_in_place():
    out = _Terminal()
    progress = demo.Progress(out)
    progress.update(5, 10, "", 0.0)
    progress.update(10, 10, "", 0.1)
    progress.end()
    text = out.getvalue()
    assert text.count("\r") == 2 and text.count("\n") == 1 and text.endswith("\n")
    assert "[" + "#" * 30 + "] 10/10 steps" in text


def _parser_calls_without_allow_abbrev_false(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    parser_names = {"ArgumentParser"} | {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and any(isinstance(b, ast.Attribute) and b.attr == "ArgumentParser" for b in node.bases)
    }
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name not in parser_names:
            continue
        if not any(
            k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
            for k in node.keywords
        ):
            bad.append(node.lineno)
    return bad


def test_every_command_line_parser_refuses_abbreviated_flags():
    paths = [REPO / "lighthouse/cli.py"] + [
        p for d in ("examples", "tools", "bench", "scripts") for p in (REPO / d).rglob("*.py")
    ]
    bad = {
        str(p.relative_to(REPO)): lines
        for p in paths
        if (lines := _parser_calls_without_allow_abbrev_false(p))
    }
    assert not bad, f"argparse parsers without allow_abbrev=False (file: lines): {bad}"
    assert len(paths) > 20  # the folders were found
