#!/usr/bin/env bash
# Installs everything the tests need into .venv, then runs the linters, the type checker and
# the test suite. This is the README's test command; .ci/run calls exactly this (the whole
# suite, slow tests included). Arguments go to pytest: `bash scripts/test.sh -m "not slow"` is
# the fast tier for the inner loop, without the tests marked slow (the CLI end to end, real
# gloo ranks, the kill -9 loops, the soak run); once .venv exists,
# `.venv/bin/python -m pytest -n 2 -m "not slow" -q` runs the same tier without reinstalling.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned: an unpinned torch pulls a several-GB CUDA build.
.venv/bin/python -m pip install -q -e ".[test]" "torch==2.13.0"
.venv/bin/ruff check deltastore tests hooks benchmarks
.venv/bin/ruff format --check deltastore tests hooks benchmarks
.venv/bin/mypy
# Compile the numba kernels once (tens of seconds on a fresh checkout; cached after), before
# the test processes that would each compile them at once.
.venv/bin/python -c "import deltastore.codecs as c; c.warm_up()"
# PYTEST_WORKERS=0 runs in one process (-n 0); the default is CI's two cores.
.venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-2}" "$@"
