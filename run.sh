#!/usr/bin/env bash
# Train the bundled tiny Qwen3 on the bundled corpus (or whatever the options say): ./run.sh [tptrain train options]
# The first run builds .venv (scripts/setup.sh); later runs start at once.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$root/scripts/setup.sh"
exec "$root/.venv/bin/tptrain" train "$@"
