#!/usr/bin/env bash
# Run the test suite (CPU, gloo): ./test.sh [pytest options], e.g. ./test.sh -k plan -x
# The first run builds .venv and .venv-vision (scripts/setup.sh); later runs start at once.
#
# Tiers (markers in pyproject.toml):
#   ./test.sh -m "not distributed and not slow"   # fast: the single-process tests, under 2 minutes on 2 cores
#   ./test.sh -m distributed                      # the multi-process ones (ranks, `tptrain train`, torchrun)
#   ./test.sh                                     # everything (what .ci/run runs)
# A test that starts processes without the `distributed` marker fails, saying so (tests/conftest.py).
#
# Two environments: the tests marked `vision` (vision-language models, whose processors need torchvision) run in
# .venv-vision, after the others, which run in .venv (the CPU torch; no torchvision). A `-m EXPR` given here
# selects within each: `EXPR and not vision` in .venv, `EXPR and vision` in .venv-vision. Either run selecting
# nothing is fine as long as one of them ran a test (pytest's exit 5 otherwise).
#
# Two pytest processes share each run's work (pytest-xdist, whole files each, so a file's shared checkpoints and
# rank pool are built once): a test spends much of its time starting processes, waiting on a collective or on a
# launcher, and the other one fills those gaps. TPTRAIN_TEST_WORKERS=N for N of them, 0 for one process (as
# does naming test files or ids, or -n / -p yourself).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$root/scripts/setup.sh"
_tptrain_setup_vision
cd "$root"
workers="${TPTRAIN_TEST_WORKERS:-2}"
split=(-n "$workers" --dist loadfile)
marker=""
args=()
while [[ $# -gt 0 ]]; do
    arg="$1"
    shift
    if [[ $arg == -m ]]; then
        marker="$1"
        shift
        continue
    elif [[ $arg == -m* ]]; then
        marker="${arg#-m}"
        continue
    fi
    if [[ $arg == -n* || $arg == --numprocesses* || $arg == -p || $arg == --collect-only || $arg == --co \
          || $arg == tests* || $arg == *::* || -e $arg ]]; then
        split=()
    fi
    args+=("$arg")
done
[[ $workers == 0 ]] && split=()
within() { if [[ -n $marker ]]; then echo "($marker) and $1"; else echo "$1"; fi; }

status=0
.venv/bin/python -m pytest -q "${split[@]}" -m "$(within "not vision")" "${args[@]}" || status=$?
vision=0
.venv-vision/bin/python -m pytest -q "${split[@]}" -m "$(within vision)" "${args[@]}" || vision=$?
# 5: that run selected no test. Fail only if both selected none, or either failed.
if [[ $status == 5 && $vision == 5 ]]; then exit 5; fi
[[ $status == 5 ]] && status=0
[[ $vision == 5 ]] && vision=0
exit $(( status != 0 ? status : vision ))
