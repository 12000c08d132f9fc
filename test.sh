#!/usr/bin/env bash
# Run the test suite (CPU, gloo): ./test.sh [pytest options], e.g. ./test.sh -k plan -x
# The first run builds .venv (scripts/setup.sh); later runs start at once.
#
# Tiers (markers in pyproject.toml):
#   ./test.sh -m "not distributed and not slow"   # fast: the single-process tests, under 2 minutes on 2 cores
#   ./test.sh -m distributed                      # the multi-process ones (ranks, `tptrain train`, torchrun)
#   ./test.sh                                     # everything (what .ci/run runs)
# A test that starts processes without the `distributed` marker fails, saying so (tests/conftest.py).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
exec .venv/bin/python -m pytest -q "$@"
