"""Which transformers model types tptrain's transformers backend trains at tp 2 from a real checkpoint: for every
causal-LM model type of the installed transformers whose config declares base_model_tp_plan, a tiny random
checkpoint written by transformers' own save_pretrained (the hub's names and layout, so load-time conversions are
exercised), loaded with `AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(tp_size=2))`
on 2 gloo ranks; logits compared with transformers on one process (fp32, rtol 1e-4), a backward pass, and
`save_pretrained` reloaded by transformers bit for bit.

    nice -n 10 .venv/bin/python scripts/hf_checkpoint_survey.py [--tp-size 2] [--types gpt_neox,dots1]

--tp-size 1 measures what is not about splitting (conversions, buffers, configs): one rank, loaded without a
distributed_config (no plan).

Prints one line per model type (OK, or the first error and where: load / forward / backward / save) and the count.
One group of ranks runs every type in turn; a type that hangs it (a collective one rank never reached) is reported
as such after --type-timeout seconds and the survey goes on in a fresh group. Tens of minutes on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from hf_backend_survey import TINY  # noqa: E402 - the same tiny sizes as the meta-device survey

# MLA attention (low-rank q/kv, decoupled RoPE): as many KV heads as query heads, consistent head sizes.
_MLA = dict(num_key_value_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32,
            q_lora_rank=32, head_dim=8)
_ONE_GROUP = dict(n_group=1, topk_group=1)  # group-limited routing over 4 experts: one group (default 8 is 0 each)
# Types on which TINY alone makes transformers itself fail: their own keys, still tiny.
TINY_OVERRIDES: dict[str, dict] = {
    **{t: _MLA for t in ("axk2", "deepseek_v2", "dots3_note_text", "glm4_moe_lite", "glm_moe_dsa", "longcat_flash",
                         "minicpm3", "youtu")},
    **{t: {**_MLA, **_ONE_GROUP} for t in ("axk1", "deepseek_v3", "deepseek_v32")},
    "bailing_hybrid": _ONE_GROUP,
    "dots1": {**_ONE_GROUP, "n_shared_experts": 1},
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"], rope_parameters={
        t: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
        for t in ("sliding_attention", "full_attention")}),
    "gemma3n_text": dict(layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0,
                         vocab_size_per_layer_input=128, hidden_size_per_layer_input=16, laurel_rank=8),
    # a composite config: the tiny keys go to its text config (else a full-size one, which no process holds)
    "llama4": dict(text_config={k: v for k, v in TINY.items() if k != "layer_types"}),
}


def tiny_config(model_type: str):
    """The tiny config of one type: TINY, then its TINY_OVERRIDES."""
    import transformers

    kwargs = {k: v for k, v in TINY.items() if k != "layer_types" or v is not None}
    return transformers.CONFIG_MAPPING[model_type](**{**kwargs, **TINY_OVERRIDES.get(model_type, {})})


def model_types() -> list[str]:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config_class = transformers.CONFIG_MAPPING[model_type]
        except (KeyError, ImportError):
            continue
        if getattr(config_class, "base_model_tp_plan", None):
            out.append(model_type)
    return out


def _write_checkpoint(model_type: str, directory: Path):
    """transformers' own random tiny model, saved; (input ids, its logits, its state dict)."""
    import torch
    import transformers

    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    ids = torch.randint(3, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    return ids, logits, {k: v.clone() for k, v in model.state_dict().items()}


def _stage(name: str, fn, state: dict) -> None:
    """Run one stage; the first error on any rank is the type's outcome on every rank."""
    from tptrain.distributed import comm

    error = None
    if "error" not in state:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a survey: record and go on
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            error = f"{name}: {type(exc).__name__}: {' '.join(lines[:2])[:240]}"  # "cannot shard ...:" + problem
            if os.environ.get("SURVEY_TRACEBACK"):
                traceback.print_exc()
    errors = [e for e in comm.all_gather_object(error) if e]
    if errors and "error" not in state:
        state["error"] = errors[0]


def _survey_type(model_type: str, root: Path, tp_size: int) -> str:
    import torch
    import transformers

    from tptrain import AutoModelForCausalLM, DistributedConfig
    from tptrain.distributed import comm

    rank = torch.distributed.get_rank()
    directory, saved = root / model_type, root / f"{model_type}-saved"
    state: dict = {}
    _stage("transformers (not tptrain) fails", lambda: state.update(
        zip(("ids", "ref", "sd"), _write_checkpoint(model_type, directory)) if rank == 0 else ()), state)
    ids = comm.all_gather_object(state.get("ids"))[0]
    # tp 1: the single-device load (no plan at all), to see what is not about splitting.
    layout = dict(distributed_config=DistributedConfig(tp_size=tp_size)) if tp_size > 1 else {}
    _stage("load", lambda: state.update(model=AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, **layout)), state)

    def forward():
        with torch.no_grad():
            logits = state["model"](ids).logits
        if rank == 0:
            torch.testing.assert_close(logits, state["ref"], rtol=1e-4, atol=1e-5)

    def backward():
        model = state["model"].train()
        model(ids, labels=ids).loss.backward()
        if not any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters()):
            raise AssertionError("no gradient reached any parameter")

    def save():
        state["model"].save_pretrained(saved)
        if rank == 0:
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).state_dict()
            bad = [k for k, v in state["sd"].items() if k not in reloaded or not torch.equal(reloaded[k], v)]
            if bad:
                raise AssertionError(f"{len(bad)} tensors differ after a save/reload, e.g. {bad[0]!r}")

    for name, fn in (("forward", forward), ("backward", backward), ("save", save)):
        _stage(name, fn, state)
    backend = getattr(state.get("model"), "backend", "?")
    return state.get("error", "OK" if backend == "transformers" else f"OK ({backend} backend)")


def worker(types: list[str], out: str, tp_size: int) -> None:
    """One rank (torchrun-style env): every type in turn; rank 0 appends {"type", "result"} lines to `out`."""
    import torch
    import transformers

    from tptrain.distributed import init_distributed

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    init_distributed()
    rank = torch.distributed.get_rank()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = comm_first(tmp)
        for model_type in types:
            if rank == 0:
                _append(out, {"type": model_type, "started": True})
            result = _survey_type(model_type, Path(tmp), tp_size)
            if rank == 0:
                _append(out, {"type": model_type, "result": result})


def comm_first(value):
    """Rank 0's value on every rank (one shared scratch directory)."""
    from tptrain.distributed import comm

    return comm.all_gather_object(value)[0]


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _launch(types: list[str], out: Path, tp_size: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp_size}",
           __file__, "--worker", "--out", str(out), "--tp-size", str(tp_size), "--types", ",".join(types)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def survey(types: list[str], tp_size: int, type_timeout: float) -> dict[str, str]:
    """Run the workers; a group that stops making progress is killed, its current type recorded as a hang."""
    out = Path(tempfile.mkdtemp()) / "results.jsonl"
    results: dict[str, str] = {}
    while len(results) < len(types):
        todo = [t for t in types if t not in results]
        proc, last, seen = _launch(todo, out, tp_size), time.monotonic(), 0
        while proc.poll() is None:
            time.sleep(2)
            lines = out.read_text().splitlines() if out.exists() else []
            if len(lines) != seen:
                seen, last = len(lines), time.monotonic()
            elif time.monotonic() - last > type_timeout:
                os.killpg(proc.pid, 9)
                proc.wait()
        records = [json.loads(line) for line in (out.read_text().splitlines() if out.exists() else [])]
        results.update({r["type"]: r["result"] for r in records if "result" in r})
        started = [r["type"] for r in records if "started" in r and r["type"] not in results]
        stuck = started[-1] if started else todo[0]
        if stuck not in results and stuck in todo:
            results[stuck] = f"hang or crash (no result within {type_timeout:.0f}s; exit {proc.returncode})"
    return {t: results[t] for t in types}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--types", default="", help="comma-separated model types (default: every one with a plan)")
    parser.add_argument("--type-timeout", type=float, default=240.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    types = [t for t in args.types.split(",") if t]
    if args.worker:
        return worker(types, args.out, args.tp_size)
    results = survey(types or model_types(), args.tp_size, args.type_timeout)
    for model_type, outcome in results.items():
        print(f"{model_type:<28} {outcome}", flush=True)
    ok = [t for t, r in results.items() if r.startswith("OK")]
    skipped = [t for t, r in results.items() if r.startswith("transformers (not tptrain)")]
    print(f"\n{len(ok)} of {len(results) - len(skipped)} model types (with a base_model_tp_plan and a tiny checkpoint "
          f"transformers itself writes) load, match and train at tp {args.tp_size}: {', '.join(ok)}")


if __name__ == "__main__":
    main()
