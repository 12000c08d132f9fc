#!/usr/bin/env bash
# tptrain's GPU check (what it checks: benchmarks/gpu_check.py's docstring). Under 10 minutes on a CUDA machine:
#   bash benchmarks/gpu_check.sh [--peak-tflops T] [--batch B --seq S --steps N --warmup W]
#   bash benchmarks/gpu_check.sh --dry-run      # the same code at tiny sizes on 2 CPU ranks (gloo, fp32)
# Python: $PYTHON, else .venv/bin/python at the repository root, else python3. Exit status 1 if any check failed.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TPTRAIN_PG_TIMEOUT="${TPTRAIN_PG_TIMEOUT:-120}"  # a hung collective fails its part well within its limit
budget=540  # seconds for all parts: each gets its own limit or what is left, whichever is less (plus 40 s to stop)

dry=0
for arg in "$@"; do [ "$arg" = --dry-run ] && dry=1; done
if [ "$dry" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
  gpus=0 ranks=2
else
  command -v nvidia-smi >/dev/null && nvidia-smi -L
  gpus="$("$py" -c 'import torch; print(torch.cuda.device_count())')" || gpus=0
  if [ "$gpus" -lt 1 ]; then
    echo "gpu_check: torch ($py) sees no CUDA GPU; run it on a CUDA machine, or pass --dry-run" >&2
    exit 2
  fi
  ranks=$(( gpus < 8 ? gpus : 8 ))
fi

out="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$out"' EXIT

# part NAME LIMIT_S NPROC ARGS...: one part, killed after its limit; its failure is recorded for the report.
part() {
  local name="$1" limit="$2" nproc="$3"
  shift 3
  local left=$(( budget - SECONDS ))
  if (( left < 15 )); then
    echo "$name: not run, the ${budget} s budget is spent" >> "$out/status"
    return
  fi
  (( limit > left )) && limit=$left
  echo "== gpu_check: $name ($nproc rank(s), limit ${limit} s)" >&2
  local cmd=("$root/benchmarks/gpu_check.py" "$@" --out "$out")
  if [ "$nproc" -gt 0 ]; then
    cmd=(-m torch.distributed.run --standalone --nproc-per-node "$nproc" "${cmd[@]}")
  fi
  local started=$SECONDS
  # SIGTERM at the limit: torchrun stops its workers (their own sessions), within 30 s; SIGKILL 40 s later
  timeout --kill-after=40 "$limit" "$py" "${cmd[@]}"
  local rc=$?
  echo "== gpu_check: $name took $(( SECONDS - started )) s (exit status $rc)" >&2
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "$name: ran past its ${limit} s limit" >> "$out/status"
  elif [ "$rc" != 0 ]; then
    echo "$name: exit status $rc (its output is above)" >> "$out/status"
  fi
}

part prepare 120 0 prepare "$@"
part comm 90 "$ranks" comm "$@"
part fused 120 $(( ranks < 2 ? 1 : 2 )) fused "$@"
for tp in 1 2 4 8; do  # the checks above first: the budget cuts the longest benchmarks, if any
  if (( tp <= ranks )); then part "train tp $tp" $(( tp == 1 ? 240 : 75 )) "$tp" train "$@"; fi
done
"$py" "$root/benchmarks/gpu_check.py" report --out "$out" "$@"
