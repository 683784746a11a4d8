"""`import torchft` resolving to torchft_like, each case in a fresh
interpreter of this venv (where pytorch/torchft itself is installed too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from torchft_like.torchft_alias import MISSING_MODULES, MODULES

pytestmark = pytest.mark.timeout(60)


def run(code: str, **env: str) -> dict:
    """Runs `code` in a fresh interpreter; it prints one JSON object."""
    environ = {k: v for k, v in os.environ.items() if k != "TORCHFT_LIKE_AS_TORCHFT"}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env={**environ, **env},
        capture_output=True, text=True, timeout=50,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr}


STARTUP = """
    import json, sys
    print(json.dumps({"torch": "torch" in sys.modules,
                      "hook": "_torchft_like_startup" in sys.modules}))
"""


def test_unset_the_start_up_hook_imports_nothing_and_torchft_is_torchft():
    assert run(STARTUP) == {"torch": False, "hook": False, "stderr": ""}
    got = run("""
        import json, torchft
        print(json.dumps({"file": torchft.__file__, "name": torchft.__name__}))
    """)
    assert got["name"] == "torchft" and "torchft_like" not in got["file"]


def test_with_the_variable_every_torchft_path_is_torchft_likes_module():
    # Set, the hook is there but loads neither torch nor torchft_like yet.
    assert run(STARTUP, TORCHFT_LIKE_AS_TORCHFT="1") == {"torch": False, "hook": True, "stderr": ""}
    got = run(f"""
        import importlib, importlib.util, json, logging
        from datetime import timedelta
        from unittest import mock
        found = importlib.util.find_spec("torchft") is not None  # torchtitan's check
        modules = {MODULES!r}
        same = {{t: importlib.import_module(t) is importlib.import_module(o)
                 for t, o in modules.items()}}
        import torchft, torchft.manager, torchft_like
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.process_group import ProcessGroupBabyGloo
        with mock.patch("torchft.manager.ManagerClient") as patched:
            seen = torchft_like.manager.ManagerClient is patched
        errors = {{}}
        # torchft's own train_ddp.py imports XCCL on every machine: it imports,
        # and refuses only when built
        from torchft import (DistributedDataParallel, DistributedSampler, Manager,
                             Optimizer, ProcessGroupGloo, ProcessGroupNCCL, ProcessGroupXCCL)
        from torchft.checkpointing.pg_transport import PGTransport
        for statement in ("ProcessGroupXCCL(timeout=timedelta(seconds=30))",
                          "from torchft.process_group import ProcessGroupBabyXCCL; "
                          "ProcessGroupBabyXCCL()",
                          "import torchft.otel", "import torchft.nonesuch"):
            try:
                exec(statement)
            except (ImportError, RuntimeError) as e:
                errors[statement] = str(e)
        print(json.dumps({{
            "found": found, "same": same, "patched": seen,
            "classes": [torchft.Manager is torchft_like.Manager,
                        torchft.ProcessGroupNCCL is torchft_like.ProcessGroupNCCL,
                        torchft.process_group.ProcessGroupBabyNCCL
                        is torchft_like.ProcessGroupBabyNCCL,
                        PGTransport is torchft_like.checkpointing.pg_transport.PGTransport,
                        torchft.Optimizer is torchft_like.Optimizer,
                        ProcessGroupBabyGloo is torchft_like.process_group.ProcessGroupBabyGloo],
            "own_spec": torchft_like.__spec__.name,
            "logger": torchft.manager.rank.logger.name,
            "errors": errors,
        }}))
    """, TORCHFT_LIKE_AS_TORCHFT="1")  # fmt: skip
    assert got["found"] and got["patched"] and all(got["classes"])
    assert got["same"] == dict.fromkeys(MODULES, True)
    assert got["own_spec"] == "torchft_like"
    assert got["logger"] == "torchft_like.manager"  # logs keep torchft_like's names
    errors = got["errors"]
    assert len(errors) == 4, errors
    assert (
        "torchft.ProcessGroupXCCL (torchft_like stands in"
        in errors["ProcessGroupXCCL(timeout=timedelta(seconds=30))"]
    )
    assert "use ProcessGroupNCCL" in errors["ProcessGroupXCCL(timeout=timedelta(seconds=30))"]
    assert any(
        "torchft.process_group.ProcessGroupBabyXCCL (torchft_like" in e for e in errors.values()
    )
    assert MISSING_MODULES["torchft.otel"] in errors["import torchft.otel"]
    assert "torchft.nonesuch" in errors["import torchft.nonesuch"]
    assert all("Differences from torchft" in e for e in errors.values())


def test_install_as_torchft_in_process_and_after_torchft_was_imported():
    got = run("""
        import json, torchft_like
        torchft_like.install_as_torchft()
        torchft_like.install_as_torchft()  # idempotent
        import torchft
        print(json.dumps({"alias": torchft is torchft_like}))
    """)
    assert got["alias"]
    got = run("""
        import json, torchft, torchft_like
        try:
            torchft_like.install_as_torchft()
            error = ""
        except RuntimeError as e:
            error = str(e)
        print(json.dumps({"error": error}))
    """)
    assert "torchft is already imported" in got["error"]
    assert "TORCHFT_LIKE_AS_TORCHFT=1" in got["error"]


def test_a_value_not_understood_is_named_once_and_leaves_torchft_alone():
    got = run(STARTUP, TORCHFT_LIKE_AS_TORCHFT="maybe")
    assert got["stderr"].count("TORCHFT_LIKE_AS_TORCHFT='maybe' is not understood") == 1
    assert not got["torch"]
