#!/usr/bin/env bash
# Installs everything the tests need into .venv, then runs the linters, the type checker and
# the test suite. This is the README's test command; .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned: an unpinned torch pulls a several-GB CUDA build.
.venv/bin/python -m pip install -q -e ".[test]" "torch==2.13.0"
.venv/bin/ruff check deltastore tests hooks benchmarks
.venv/bin/ruff format --check deltastore
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
