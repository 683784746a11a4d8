#!/usr/bin/env bash
# The opt-in integration suite: real client frameworks driving torchft_like
# through `import torchft`, beside pytorch/torchft running the same jobs.
#
#   scripts/integration.sh            Ray Train and torchtitan (tests/clients), in
#                                     .venv-integration: torch pinned first, then
#                                     .[dev,integration,bench] (bench: torchft nightly);
#                                     and nghttp2's h2load against the lean lighthouse
#                                     (tests/integration/test_h2load.py)
#   scripts/integration.sh torchft-0.2
#                                     a torchft 0.2.0 group sharing an allreduce with
#                                     ours, in .venv-torchft020 (one torchft per venv)
#
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

venv() {  # venv DIR EXTRA_SPEC...: torch pinned first, so no CUDA build is pulled
    local dir=$1
    shift
    [ -x "$dir/bin/python" ] || "$PYTHON" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip
    "$dir/bin/python" -m pip install -q "$TORCH_SPEC"
    "$dir/bin/python" -m pip install -q "$@"
}

if [ "${1:-}" = "torchft-0.2" ]; then
    shift
    venv .venv-torchft020 "torchft==0.2.0" -e ".[dev]"
    exec .venv-torchft020/bin/python -m pytest -m integration \
        tests/integration/test_torchft_020_mixed.py "$@"
fi
# h2load (Debian's nghttp2-client): an HTTP/2 client independent of grpcio, for test_h2load.
command -v h2load >/dev/null || { apt-get update -qq && apt-get install -y -qq nghttp2-client; } \
    || echo "nghttp2-client could not be installed: tests/integration/test_h2load.py will skip"
venv .venv-integration -e ".[dev,integration,bench]"
exec .venv-integration/bin/python -m pytest -m integration tests/clients \
    tests/integration/test_h2load.py "$@"
