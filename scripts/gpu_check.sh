#!/usr/bin/env bash
# The GPU check (issue 46): one command, at most 8 minutes on a GPU machine.
# Writes one JSON object, a line per check, to stdout and to --out (default
# gpu_check.json); each check's pytest output goes under --logs. On a machine
# without CUDA it runs nothing and reports every check skipped, exit 0.
#   bash scripts/gpu_check.sh [--out PATH] [--budget-s S] [--only NAME ...]
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
[ -x "$python" ] || python=python3
# The driver bounds every check and the whole run itself; this is the last
# guard, so a wedged driver still ends within the issue's 8 minutes.
exec timeout -k 5 475 "$python" scripts/gpu_check.py "$@"
