#!/usr/bin/env bash
# The opt-in integration suite: real client frameworks (Ray Train) driving
# torchft_like through `import torchft`. Installs them, pinned, into a venv of
# their own (.venv-integration: torch pinned first, then .[dev,integration]),
# then runs `pytest -m integration`. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV=.venv-integration
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
"$VENV/bin/python" -m pip install -q -e ".[dev,integration]"
exec "$VENV/bin/python" -m pytest -m integration tests/clients "$@"
