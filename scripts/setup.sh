#!/usr/bin/env bash
# Build .venv for tptrain, idempotently. run.sh and test.sh source this; `bash scripts/setup.sh` works too.
#
#   1. create .venv with python3 (>= 3.10) if it is missing;
#   2. torch: without an NVIDIA GPU (no nvidia-smi) or with TPTRAIN_CPU=1, the CPU build of torch 2.13.0,
#      from the default index when that serves a CPU wheel, else from PyTorch's CPU index; with a GPU, an
#      installed torch is kept, otherwise the default `pip install torch`;
#   3. pip install -e ".[test,hf,dev]" (dev: the pinned ruff .ci/run lints with), with the torch just settled
#      pinned as a constraint, so that resolving transformers or peft can never swap it for another (multi-GB CUDA)
#      build.
#
# With --vision (or _tptrain_setup_vision after sourcing it, as test.sh does), also .venv-vision, the environment
# of the vision-language models (their processors need torchvision, which does not import beside the CPU build of
# torch 2.13.0): the same steps, with torch 2.14.1 and torchvision 0.29.1 on a CPU machine (a CUDA build from the
# default index, several GB, which runs on the CPU), or on a GPU machine the installed torch kept and a matching
# torchvision installed only if missing, then tptrain[test,hf,dev,vision] with both pinned as constraints. The text-only path (.venv, run.sh)
# never imports torchvision.
# A stamp in each venv holds a checksum of pyproject.toml, this file and the CPU/GPU choice; while it matches,
# nothing is run, so sourcing this costs milliseconds. Progress goes to stderr.

_tptrain_log() { echo "setup.sh: $*" >&2; }

# Exit 0 when `pip install torch==VERSION` from the configured indexes would install a CPU build,
# judged from pip's resolution report (metadata only, no multi-GB download).
_tptrain_plain_torch_is_cpu() {
    local py="$1" version="$2" report
    report="$(mktemp)" || return 1
    "$py" -m pip install -q --dry-run --ignore-installed --no-deps --report "$report" "torch==$version" >&2 \
        && "$py" - "$report" <<'EOF'
import json, sys
meta = json.load(open(sys.argv[1]))["install"][0]["metadata"]
local = meta["version"].partition("+")[2]  # "cpu", "cu128", ... or "" for a plain PyPI wheel
cuda = local not in ("", "cpu") or any(r.startswith("nvidia-") for r in meta.get("requires_dist") or [])
sys.exit(1 if cuda else 0)
EOF
    local rc=$?
    rm -f "$report"
    return $rc
}

_tptrain_install_torch() {
    local py="$1" mode="$2" cpu_version=2.13.0
    if [[ $mode == gpu ]]; then
        "$py" -c 'import torch' 2>/dev/null && return 0
        _tptrain_log "installing torch (default build)"
        "$py" -m pip install -q torch >&2
        return
    fi
    "$py" -W ignore -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$cpu_version' or torch.version.cuda is not None)" \
        2>/dev/null && return 0
    # An installed torch of another version or a CUDA build would satisfy pip's ==; remove it first.
    "$py" -m pip uninstall -q -y torch >/dev/null 2>&1
    if _tptrain_plain_torch_is_cpu "$py" "$cpu_version"; then
        _tptrain_log "installing torch==$cpu_version (CPU build)"
        "$py" -m pip install -q "torch==$cpu_version" >&2 || return 1
    else
        _tptrain_log "installing torch==$cpu_version from PyTorch's CPU index"
        "$py" -m pip install -q "torch==$cpu_version" --index-url https://download.pytorch.org/whl/cpu >&2 || return 1
    fi
    "$py" -W ignore -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' && return 0
    _tptrain_log "the torch just installed is a CUDA build; install a CPU build into .venv by hand, or unset TPTRAIN_CPU"
    return 1
}

# torch and torchvision that import together, for .venv-vision: on a CPU machine torch 2.14.1 and torchvision
# 0.29.1 (the default index's builds); on a GPU machine the installed torch (else the default one) and, only if
# none imports, the torchvision pip resolves against that torch.
_tptrain_install_vision_torch() {
    local py="$1" mode="$2" torch_version=2.14.1 vision_version=0.29.1 constraints
    if [[ $mode == gpu ]]; then
        _tptrain_install_torch "$py" gpu || return 1
        "$py" -c 'import torchvision' 2>/dev/null && return 0
        constraints="$(mktemp)" || return 1
        "$py" -c 'from importlib.metadata import version; print("torch==" + version("torch"))' >"$constraints"
        _tptrain_log "installing the torchvision matching $(cat "$constraints")"
        "$py" -m pip install -q -c "$constraints" torchvision >&2
        local rc=$?
        rm -f "$constraints"
        return $rc
    fi
    "$py" -W ignore -c "import sys, torch, torchvision
sys.exit(torch.__version__.split('+')[0] != '$torch_version' or torchvision.__version__.split('+')[0] != '$vision_version')" \
        2>/dev/null && return 0
    "$py" -m pip uninstall -q -y torch torchvision >/dev/null 2>&1
    _tptrain_log "installing torch==$torch_version torchvision==$vision_version (several GB; they run on the CPU)"
    "$py" -m pip install -q "torch==$torch_version" "torchvision==$vision_version" >&2
}

# Build one venv: _tptrain_setup_venv NAME EXTRAS TORCH_INSTALLER
_tptrain_setup_venv() {
    local name="$1" extras="$2" install_torch="$3" root venv py mode stamp key constraints
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
    venv="$root/$name"
    py="$venv/bin/python"
    mode=gpu
    if [[ ${TPTRAIN_CPU:-0} == 1 ]] || ! command -v nvidia-smi >/dev/null 2>&1; then mode=cpu; fi
    stamp="$venv/.tptrain-setup-stamp"
    key="$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | cksum) $mode"  # cksum: in POSIX, unlike sha256sum
    [[ -x $py && -f $stamp && "$(cat "$stamp")" == "$key" ]] && return 0

    if [[ ! -x $py ]]; then
        if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
            _tptrain_log "tptrain needs python3 >= 3.10 on PATH (found: $(python3 --version 2>&1))"
            return 1
        fi
        _tptrain_log "creating $venv"
        python3 -m venv "$venv" || return 1
    fi
    "$install_torch" "$py" "$mode" || return 1
    constraints="$venv/.tptrain-torch-constraint.txt"
    "$py" - >"$constraints" <<'EOF' || return 1
from importlib.metadata import PackageNotFoundError, version
for name in ("torch", "torchvision"):  # torchvision: .venv-vision's only
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass
EOF
    _tptrain_log "installing tptrain[$extras] (editable) into $name with $(tr '\n' ' ' <"$constraints")"
    "$py" -m pip install -q -c "$constraints" -e "$root[$extras]" >&2 || return 1
    echo "$key" >"$stamp"
    _tptrain_log "$name ready ($mode)"
}

_tptrain_setup() {
    _tptrain_setup_venv .venv test,hf,dev _tptrain_install_torch
}

_tptrain_setup_vision() {
    _tptrain_setup_venv .venv-vision test,hf,dev,vision _tptrain_install_vision_torch
}

# Sourced, the caller's arguments are its own (run.sh's flags): only .venv is built, and a caller that wants
# .venv-vision calls _tptrain_setup_vision (test.sh). Run, `bash scripts/setup.sh --vision` builds both.
if (return 0 2>/dev/null); then
    _tptrain_setup || return 1
elif [[ $# -gt 1 || $# -eq 1 && $1 != --vision ]]; then
    _tptrain_log "usage: bash scripts/setup.sh [--vision] (--vision: also build .venv-vision)"
    exit 2
else
    _tptrain_setup || exit 1
    if [[ $# -eq 1 ]]; then _tptrain_setup_vision || exit 1; fi
fi
