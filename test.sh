#!/usr/bin/env bash
# Run the test suite (CPU, gloo): ./test.sh [pytest options], e.g. ./test.sh -k plan -x
# The first run builds .venv (scripts/setup.sh); later runs start at once.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$root/scripts/setup.sh"
cd "$root"
exec .venv/bin/python -m pytest -q "$@"
