"""Which transformers model types tptrain's transformers backend runs at a tp size, on real checkpoints: for each
type a tiny random checkpoint written by transformers' own save_pretrained, loaded with
`AutoModelForCausalLM.from_pretrained(dir, distributed_config=DistributedConfig(tp_size=N))` on N gloo ranks
(one process group for all types), its fp64 logits compared with transformers' on one process, and a backward.

    PYTHONPATH=. .venv/bin/python scripts/hf_styles_check.py --tp-size 2 [--ep] gemma glm apertus

Prints one line per type: OK (max |logits difference|) or the first error. For the layouts (styles), not the
load-time conversions (scripts/hf_checkpoint_survey.py surveys every type).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
            num_experts_per_tok=2, shared_expert_intermediate_size=32, first_k_dense_replace=0, sliding_window=16)
# What a type's tiny config needs beyond TINY (its own field names, consistent sizes).
EXTRA: dict[str, dict] = {
    "minicpm3": dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16),
    "nemotron_h": dict(hybrid_override_pattern="M*", mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
                       ssm_state_size=16, layers_block_type=None),
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"]),
}


def write_checkpoint(model_type: str, root: Path) -> tuple[Path, dict]:
    """(directory written by transformers, {"logits", "loss"} of transformers in fp64 on the batch)."""
    import transformers

    from tests.helpers.checkpoints import randomize
    from tests.helpers.references import hf_reference
    torch.manual_seed(0)
    fields = {**TINY, **EXTRA.get(model_type, {})}
    config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in fields.items() if v is not None})
    config.use_cache = False  # hybrid types: a cache of only linear-attention layers has no sequence length
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    if hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation("eager")  # its grouped_mm kernels take no fp64
    randomize(hf, norm_weight=0.0 if "gemma" in model_type else 1.0)
    path = root / model_type
    hf.save_pretrained(path)
    return path, hf_reference(hf.to(torch.float64))


def _worker(tp: int, checkpoints: dict, out: Path, ep: bool) -> None:
    import torch.distributed as dist

    from tests.helpers.batches import batch
    from tptrain import AutoModelForCausalLM, DistributedConfig
    results = {}
    for model_type, (path, expected) in checkpoints.items():
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                         distributed_config=DistributedConfig(
                tp_size=tp, enable_expert_parallel=ep))
            ids, labels = batch()
            with torch.no_grad():
                diff = (model(ids).logits - expected["logits"]).abs().max().item()
            model(ids, labels=labels).loss.backward()
            results[model_type] = f"{'OK' if diff < 1e-5 else 'WRONG'} (max |logits diff| {diff:.1e})"
        except Exception as exc:  # noqa: BLE001 - a survey: record and go on
            line = str(exc).strip().splitlines()[-1][:300] if str(exc) else ""
            where = traceback.extract_tb(exc.__traceback__)[-1]
            results[model_type] = f"error: {type(exc).__name__}: {line} [{Path(where.filename).name}:{where.lineno}]"
        if dist.is_initialized():
            dist.barrier()
    if int(os.environ["RANK"]) == 0:
        torch.save(results, out)


def _random_worker(tp: int, types: list[str], out: Path) -> None:
    """No checkpoint (types whose checkpoints transformers converts while loading): the same random init on every
    rank, parallelized in memory, against the unsharded copy: logits and every gathered gradient."""
    import copy

    import transformers

    from tests.helpers.batches import batch
    from tests.helpers.checkpoints import randomize
    from tests.helpers.compare import full_grads
    from tptrain import DistributedConfig
    from tptrain.hf.model import TransformersCausalLM
    results = {}
    for model_type in types:
        try:
            fields = {**TINY, **EXTRA.get(model_type, {})}
            config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in fields.items() if v is not None})
            config.use_cache = False
            torch.manual_seed(0)
            ref = TransformersCausalLM.from_config(config, dtype=torch.float64)
            randomize(ref.hf_model)
            model = copy.deepcopy(ref).parallelize(DistributedConfig(tp_size=tp))
            ids, labels = batch()
            diff = (model(ids).logits - ref(ids).logits).abs().max().item()
            model(ids, labels=labels).loss.backward(), ref(ids, labels=labels).loss.backward()
            grads = full_grads(model)
            gdiff = max((grads[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())
            ok = diff < 1e-5 and gdiff < 1e-5
            results[model_type] = f"{'OK' if ok else 'WRONG'} (random init: logits {diff:.1e}, grads {gdiff:.1e})"
        except Exception as exc:  # noqa: BLE001 - a survey: record and go on
            line = str(exc).strip().splitlines()[-1][:300] if str(exc) else ""
            results[model_type] = f"error (random init): {type(exc).__name__}: {line}"
    if int(os.environ["RANK"]) == 0:
        torch.save(results, out)


def main() -> None:
    from tests.helpers.ranks import run_distributed
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--ep", action="store_true", help="enable_expert_parallel (MoE types)")
    parser.add_argument("--random", action="store_true", help="random init parallelized in memory, no checkpoint")
    parser.add_argument("types", nargs="+")
    args = parser.parse_args()
    if args.random:
        with tempfile.TemporaryDirectory() as tmp:
            run_distributed(_random_worker, args.tp_size, args.tp_size, args.types, Path(tmp) / "r.pt", timeout=900)
            for model_type, line in torch.load(Path(tmp) / "r.pt").items():
                print(f"{model_type:<24} {line}")
        return
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpoints, results = {}, {}
        for model_type in args.types:
            try:
                checkpoints[model_type] = write_checkpoint(model_type, Path(tmp))
            except Exception as exc:  # noqa: BLE001
                results[model_type] = f"checkpoint not written: {type(exc).__name__}: {str(exc)[:200]}"
        out = Path(tmp) / "results.pt"
        run_distributed(_worker, args.tp_size, args.tp_size, checkpoints, out, args.ep, timeout=900)
        results.update(torch.load(out))
    for model_type in args.types:
        print(f"{model_type:<24} {results[model_type]}")


if __name__ == "__main__":
    main()
