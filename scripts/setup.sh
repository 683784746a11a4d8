#!/usr/bin/env bash
# Creates .venv and installs torchft_like with its dev and bench extras, from
# nothing (bench: pytorch/torchft, the reference the benchmarks and a
# wire-compatibility test measure against; the library never imports it).
# torch is installed first and pinned, so no multi-GB CUDA build is pulled on
# a machine without a GPU. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -e ".[dev,bench]"
