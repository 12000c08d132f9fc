#!/usr/bin/env bash
# Run the test suite (CPU, gloo): ./test.sh [pytest options], e.g. ./test.sh -k plan -x
# The first run builds .venv (scripts/setup.sh); later runs start at once.
#
# Tiers (markers in pyproject.toml):
#   ./test.sh -m "not distributed and not slow"   # fast: the single-process tests, under 2 minutes on 2 cores
#   ./test.sh -m distributed                      # the multi-process ones (ranks, `tptrain train`, torchrun)
#   ./test.sh                                     # everything (what .ci/run runs)
# A test that starts processes without the `distributed` marker fails, saying so (tests/conftest.py).
#
# Two pytest processes share the work (pytest-xdist, whole files each, so a file's shared checkpoints and rank
# pool are built once): a test spends much of its time starting processes, waiting on a collective or on a
# launcher, and the other one fills those gaps. TPTRAIN_TEST_WORKERS=N for N of them, 0 for one process (as
# does naming test files or ids, or -n / -p yourself).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
workers="${TPTRAIN_TEST_WORKERS:-2}"
split=(-n "$workers" --dist loadfile)
for arg in "$@"; do
    if [[ $arg == -n* || $arg == --numprocesses* || $arg == -p || $arg == --collect-only || $arg == --co \
          || $arg == tests* || $arg == *::* || -e $arg ]]; then
        split=()
    fi
done
[[ $workers == 0 ]] && split=()
exec .venv/bin/python -m pytest -q "${split[@]}" "$@"
