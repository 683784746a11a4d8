#!/usr/bin/env bash
# Creates .venv and installs torchft_like with its dev extra, from nothing.
# torch is installed first and pinned, so no multi-GB CUDA build is pulled on
# a machine without a GPU. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -e ".[dev]"
