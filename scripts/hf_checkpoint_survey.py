"""Which transformers model types tptrain's transformers backend trains from a real checkpoint, stage by stage: for
every causal-LM model type of the installed transformers whose config declares base_model_tp_plan, a tiny random
checkpoint written by transformers' own save_pretrained (the hub's names and layout, so load-time conversions are
exercised), loaded with `AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(tp_size=N))`
on N gloo ranks, each stage against transformers on one process (fp32; scripts/hf_survey_stages.py):

    load      tptrain's from_pretrained at tp N (the transformers backend)
    forward   logits, relative error (max |diff| / max |logit|) <= 1e-5
    backward  every gradient (gathered) finite and within 1e-4 of transformers' (relative to its largest entry,
              + 1e-6 of the model's largest gradient entry)
    steps     the model loaded again in fp64 on both sides (fp32 for a checkpoint over 256 MiB or where
              transformers fails in fp64): the losses of 3 AdamW steps (lr 1e-3, eps 1e-6; and the one after)
              within 1e-7 (fp32 logits: 1e-5) relative of transformers' own training on one process
    save      save_pretrained after one AdamW step on the backward's gradients, reloaded by transformers: every
              tensor bit for bit what transformers' own save_pretrained of the same weights reloads as
    plan      `tptrain plan` (plan_report) finds no problem and its bytes per rank are what a loaded rank holds
    peer      (--peer) transformers' own TP, from_pretrained(dir, distributed_config=transformers.DistributedConfig(
              tp_size=N)) on the same ranks: do its logits equal its single-process ones (1e-5)?

    nice -n 10 .venv/bin/python scripts/hf_checkpoint_survey.py --tp-size 2 --peer [--types gpt_neox,dots1]
    nice -n 10 .venv/bin/python scripts/hf_checkpoint_survey.py --tp-size 4 --expert-parallel   # the MoE types

--expert-parallel loads tptrain with enable_expert_parallel (the experts split by expert over the TP group, as
transformers' base_model_ep_plan), over the types with an ep plan (--peer stays transformers' plain TP: its
enable_expert_parallel asks for a tp_plan these types' configs do not give it).

--tp-size 1 measures what is not about splitting (conversions, buffers, configs): one rank, loaded without a
distributed_config (no plan). A stage after a failed one is "-". Prints a markdown table (type x stages), the
reason for each failure, and the count. One group of ranks runs every type in turn; a type that hangs it (a
collective one rank never reached) is reported as such after --type-timeout seconds and the survey goes on in a
fresh group. Tens of minutes on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from hf_backend_survey import TINY  # the same tiny sizes as the meta-device survey
from hf_survey_stages import LAYOUT_STAGES, STAGES, reference, run_layout_stages, run_stages, steps_dtype

# MLA attention (low-rank q/kv, decoupled RoPE): as many KV heads as query heads, consistent head sizes.
_MLA = dict(num_key_value_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, kv_lora_rank=32,
            q_lora_rank=32, head_dim=8)
_ONE_GROUP = dict(n_group=1, topk_group=1)  # group-limited routing over 4 experts: one group (default 8 is 0 each)
# Types on which TINY alone makes transformers itself fail: their own keys, still tiny.
TINY_OVERRIDES: dict[str, dict] = {
    **{t: _MLA for t in ("axk2", "deepseek_v2", "dots3_note_text", "glm4_moe_lite", "glm_moe_dsa", "longcat_flash",
                         "minicpm3", "youtu")},
    **{t: {**_MLA, **_ONE_GROUP} for t in ("axk1", "deepseek_v3", "deepseek_v32")},
    # hybrids: one recurrent layer and one attention layer (their defaults make both first layers recurrent)
    **{t: dict(layer_types=["linear_attention", "full_attention"]) for t in (
        "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")},
    "kimi_linear": dict(_MLA, layer_types=["linear_attention", "full_attention"]),  # its attention is MLA
    "bailing_hybrid": dict(_MLA, **_ONE_GROUP, layer_types=["linear_attention", "full_attention"]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "dots1": {**_ONE_GROUP, "n_shared_experts": 1},
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"], rope_parameters={
        t: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
        for t in ("sliding_attention", "full_attention")}),
    "gemma3n_text": dict(layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0,
                         vocab_size_per_layer_input=128, hidden_size_per_layer_input=16, laurel_rank=8),
    # one MoE layer of two (their defaults make the first layers dense: a tiny model had no experts)
    "beam": dict(mlp_layer_types=["dense", "sparse"], **_ONE_GROUP),
    "flint": dict(mlp_only_layers=[0]),
    "longcat_flash": dict(_MLA, num_layers=2, num_hidden_layers=4),  # two layers of two sublayers: pp 2 can cut it
    "gemma4_text": dict(vocab_size_per_layer_input=128, hidden_size_per_layer_input=16),  # 262144 rows by default
    # a composite config: the tiny keys go to its text config (else a full-size one, which no process holds)
    "llama4": dict(text_config={k: v for k, v in TINY.items() if k != "layer_types"}),
}


# Under --expert-parallel only: the MoE variant of a type whose tiny config is otherwise dense (Gemma 4 26B-A4B).
EP_OVERRIDES: dict[str, dict] = {
    "gemma4_text": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
}


def tiny_config(model_type: str, expert_parallel: bool = False):
    """The tiny config of one type: TINY, then its TINY_OVERRIDES (and EP_OVERRIDES with `expert_parallel`)."""
    import transformers

    kwargs = {k: v for k, v in TINY.items() if k != "layer_types" or v is not None}
    extra = {**TINY_OVERRIDES.get(model_type, {}), **(EP_OVERRIDES.get(model_type, {}) if expert_parallel else {})}
    return transformers.CONFIG_MAPPING[model_type](**{**kwargs, **extra})


def model_types(expert_parallel: bool = False) -> list[str]:
    """The causal-LM types of the installed transformers whose config declares base_model_tp_plan (with
    `expert_parallel`: also base_model_ep_plan)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config_class = transformers.CONFIG_MAPPING[model_type]
        except (KeyError, ImportError):
            continue
        if getattr(config_class, "base_model_tp_plan", None) and (
                not expert_parallel or getattr(config_class, "base_model_ep_plan", None)):
            out.append(model_type)
    return out


def _write_checkpoint(model_type: str, directory: Path, ep: bool) -> tuple[torch.Tensor, dict]:
    """transformers' own random tiny model, saved; (input ids, transformers' single-process reference)."""
    import transformers

    config = tiny_config(model_type, ep)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    ids = torch.randint(3, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    return ids, reference(model, ids, steps_dtype(directory))


def _survey_type(model_type: str, root: Path, layout: tuple[int, int, int], peer: bool, ep: bool) -> dict:
    from tptrain.distributed import comm

    rank = torch.distributed.get_rank()
    directory, saved = root / model_type, root / f"{model_type}-saved"
    written, error = None, None
    if rank == 0:
        try:
            written = _write_checkpoint(model_type, directory, ep)
        except Exception as exc:  # noqa: BLE001 - a survey: record and go on
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:240] if str(exc) else ''}"
    error = comm.all_gather_object(error)[0]
    if error:
        return {"error": f"transformers (not tptrain) fails: {error}"}
    ids, dtype = comm.all_gather_object((written[0], written[1]["steps_dtype"]) if written else None)[0]
    tp, cp, pp = layout
    try:
        if cp * pp > 1:
            return run_layout_stages(directory, ids, written[1] if written else None, tp=tp, cp=cp, pp=pp,
                                     steps_dtype=dtype)
        return run_stages(directory, saved, ids, written[1] if written else None, tp, peer, steps_dtype=dtype,
                          expert_parallel=ep)
    finally:
        comm.all_gather_object(None)  # every rank done with the files
        if rank == 0:  # phi4_multimodal's full-size towers make GBs
            for path in root.glob(f"{model_type}*"):
                shutil.rmtree(path, ignore_errors=True)


def worker(types: list[str], out: str, layout: tuple[int, int, int], peer: bool, ep: bool) -> None:
    """One rank (torchrun-style env): every type in turn; rank 0 appends {"type", "result"} lines to `out`."""
    import transformers

    from tptrain.distributed import comm, init_distributed

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    init_distributed()
    rank = torch.distributed.get_rank()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = comm.all_gather_object(tmp)[0]  # rank 0's: one shared scratch directory
        for model_type in types:
            if rank == 0:
                _append(out, {"type": model_type, "started": True})
            result = _survey_type(model_type, Path(tmp), layout, peer, ep)
            if rank == 0:
                _append(out, {"type": model_type, "result": result})


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _launch(script: str, nproc: int, types: list[str], out: Path, args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script,
           "--worker", "--out", str(out), "--types", ",".join(types), *args]
    log = open(out.with_suffix(".log"), "ab")  # the workers' output, for a crash's cause
    return subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)


def survey(types: list[str], layout: tuple[int, int, int], type_timeout: float, peer: bool,
           ep: bool) -> dict[str, dict]:
    """This script's workers at `layout` over `types` (survey_loop)."""
    tp, cp, pp = layout
    args = ["--tp-size", str(tp), "--cp-size", str(cp), "--pp-size", str(pp), *(["--peer"] if peer else []),
            *(["--expert-parallel"] if ep else [])]
    return survey_loop(types, __file__, tp * cp * pp, args, type_timeout)


def survey_loop(types: list[str], script: str, nproc: int, args: list[str], type_timeout: float) -> dict[str, dict]:
    """Run `script`'s workers (`--worker`, on `nproc` ranks, with `args`); a group that stops making progress is
    killed, its current type recorded as a hang, and the rest go on in a fresh group."""
    out = Path(tempfile.mkdtemp()) / "results.jsonl"
    results: dict[str, dict] = {}
    while len(results) < len(types):
        todo = [t for t in types if t not in results]
        proc, last, seen = _launch(script, nproc, todo, out, args), time.monotonic(), 0
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
            results[stuck] = {"error": f"hang or crash (no result within {type_timeout:.0f}s; exit {proc.returncode}; "
                                       f"log {out.with_suffix('.log')})"}
    return {t: results[t] for t in types}


def _stages(result: dict) -> tuple[str, ...]:
    return LAYOUT_STAGES if "train" in result else STAGES


def passed(result: dict) -> bool:
    return all(result.get(stage) == "OK" for stage in _stages(result))


def spelled(layout: tuple[int, int, int]) -> str:
    """'tp 2', 'cp 2', 'tp 2 x cp 2 x pp 2': the axes above 1 (tp always when alone)."""
    parts = [f"{axis} {size}" for axis, size in zip(("tp", "cp", "pp"), layout) if size > 1]
    return " x ".join(parts) or "tp 1"


def table(results: dict[str, dict], layout: tuple[int, int, int], peer: bool) -> str:
    """The markdown table (type x stages, the peer column) and, below it, the reason for each failure."""
    stages = LAYOUT_STAGES if layout[1] * layout[2] > 1 else STAGES
    head = ["type", "layout", *stages, *([f"peer (transformers TP {layout[0]})"] if peer else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    reasons = []
    for model_type, r in results.items():
        cells = [r.get(stage, "-") for stage in stages] if any(s in r for s in stages) else ["n/a"] * len(stages)
        peer_cell = r.get("peer", "-")
        peer_cell = "OK" if peer_cell == "OK" else peer_cell.split(" (")[0].split(":")[0]
        lines.append(f"| `{model_type}` | {spelled(layout)} | " + " | ".join([*cells, *([peer_cell] if peer else [])])
                     + " |")
        if "error" in r:
            reasons.append(f"- `{model_type}` ({spelled(layout)}): {r['error']}")
        if peer and r.get("peer", "OK") != "OK":
            reasons.append(f"- `{model_type}` (transformers' own TP at tp {layout[0]}): {r['peer']}")
    return "\n".join([*lines, "", *reasons])


def cell(result: dict | None) -> str:
    """One type's outcome in one run, for the combined table: OK, refused (the rule's words), or the failed stage."""
    if result is None:
        return "not run"
    if passed(result):
        return "OK"
    error = result.get("error", "")
    if error.startswith("transformers (not tptrain)"):
        return "n/a (transformers fails)"
    if "cannot run with cp_size" in error or "cannot be cut into pipeline stages" in error:
        return "refused"
    return f"**{error.split(':')[0]}** fails"


def combined(runs: dict[str, dict[str, dict]]) -> str:
    """{column title: a run's --json results} -> one markdown table, a row per type and a column per run, then each
    refusal's and failure's reason."""
    types = sorted({t for results in runs.values() for t in results})
    lines = ["| type | " + " | ".join(runs) + " |", "|---" * (len(runs) + 1) + "|"]
    lines += [f"| `{t}` | " + " | ".join(cell(results.get(t)) for results in runs.values()) + " |" for t in types]
    reasons = [f"- `{t}` ({title}): {results[t]['error']}" for title, results in runs.items() for t in types
               if t in results and not passed(results[t]) and "error" in results[t]]
    counts = [f"{title}: {sum(passed(r) for r in results.values())} of {len(results)}" for title, results in runs.items()]
    return "\n".join([*lines, "", "Passing: " + "; ".join(counts) + ".", "", *reasons])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--cp-size", type=int, default=1, help="context parallelism: the layout stages (Trainer)")
    parser.add_argument("--pp-size", type=int, default=1, help="pipeline parallelism: the layout stages (Trainer)")
    parser.add_argument("--types", default="", help="comma-separated model types (default: every one with a plan)")
    parser.add_argument("--peer", action="store_true", help="also run transformers' own TP at --tp-size (slower)")
    parser.add_argument("--expert-parallel", action="store_true",
                        help="enable_expert_parallel (experts split by expert over the TP group, transformers' "
                             "base_model_ep_plan) on both sides; default types: those with an ep plan")
    parser.add_argument("--json", help="also write the results to this file ({type: {stage: outcome, ...}})")
    parser.add_argument("--combine", nargs="+", metavar="TITLE=FILE",
                        help="print one table of several runs' --json files (a column each) and exit")
    parser.add_argument("--type-timeout", type=float, default=300.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.combine:
        runs = {title: json.loads(Path(path).read_text()) for title, _, path in
                (item.partition("=") for item in args.combine)}
        return print(combined(runs))
    types = [t for t in args.types.split(",") if t]
    layout = (args.tp_size, args.cp_size, args.pp_size)
    if args.worker:
        return worker(types, args.out, layout, args.peer, args.expert_parallel)
    if (args.peer or args.expert_parallel) and args.cp_size * args.pp_size > 1:
        parser.error("--peer and --expert-parallel are for the tp stages (no --cp-size / --pp-size)")
    results = survey(types or model_types(expert_parallel=args.expert_parallel), layout, args.type_timeout,
                     args.peer, args.expert_parallel)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(table(results, layout, args.peer), flush=True)
    ok = [t for t, r in results.items() if passed(r)]
    skipped = [t for t, r in results.items() if r.get("error", "").startswith("transformers (not tptrain)")]
    print(f"\n{len(ok)} of {len(results) - len(skipped)} model types (with a base_model_tp_plan and a tiny checkpoint "
          f"transformers itself writes) pass every stage at {spelled(layout)}"
          f"{' with enable_expert_parallel' if args.expert_parallel else ''}: {', '.join(ok)}")
    if args.peer:
        peers = [t for t, r in results.items() if r.get("peer") == "OK"]
        print(f"transformers' own TP at tp {args.tp_size} matches its single-process logits on {len(peers)}: "
              f"{', '.join(peers)}")


if __name__ == "__main__":
    main()
