#!/usr/bin/env bash
# Builds the documentation site (mkdocs.yml: docs/ and the API reference from
# the docstrings) into site/, warnings as errors: a link, a cross-reference or
# a docstring section that points nowhere fails the build. The tools come with
# the dev extra (scripts/setup.sh); a .venv made without them gets the docs
# extra here. Extra arguments go to `mkdocs build`.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
.venv/bin/python -c "import material, mkdocstrings_handlers.python" 2>/dev/null \
    || .venv/bin/python -m pip install -q -e ".[docs]"
# NO_MKDOCS_2_WARNING: mkdocs-material's banner about its successor, not about these docs.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict "$@"
