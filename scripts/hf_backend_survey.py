"""Which transformers model types tptrain's transformers backend loads at tp 2: a loop over every causal-LM
model type of the installed transformers whose config declares base_model_tp_plan, each built from a tiny config
on the meta device (no weights, no process group) with the plan checked by the same `check_plan` that
`from_pretrained` runs on every rank.

    .venv/bin/python scripts/hf_backend_survey.py [--tp-size 2]

Prints one line per model type (OK, or the first problem) and the list of those that load. A few seconds.
"""
from __future__ import annotations

import argparse
import warnings

# Small sizes under the names transformers' configs use; a config ignores the ones it does not have.
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
            num_experts_per_tok=2, shared_expert_intermediate_size=32, first_k_dense_replace=0,
            layer_types=None, sliding_window=16)


def survey(tp_size: int) -> dict[str, str]:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from tptrain.hf.model import TransformersCausalLM
    from tptrain.models.auto import MODEL_REGISTRY
    from tptrain.parallel.plan import check_plan

    transformers.logging.set_verbosity_error()
    out = {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config_class = transformers.CONFIG_MAPPING[model_type]
        except (KeyError, ImportError) as exc:
            out[model_type] = f"skipped: no config class ({type(exc).__name__})"
            continue
        if not getattr(config_class, "base_model_tp_plan", None):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = config_class(**{k: v for k, v in TINY.items() if k != "layer_types" or v is not None})
                model = TransformersCausalLM.from_config(config, device="meta")
            problems = check_plan(model, "auto", tp_size).problems
            out[model_type] = "OK" if not problems else f"problem: {problems[0]}"
        except Exception as exc:  # noqa: BLE001 - a survey: record and go on
            out[model_type] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        if model_type in MODEL_REGISTRY:
            out[model_type] += " (native in tptrain too)"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp-size", type=int, default=2)
    args = parser.parse_args()
    results = survey(args.tp_size)
    for model_type, outcome in results.items():
        print(f"{model_type:<28} {outcome}")
    ok = [t for t, r in results.items() if r.startswith("OK")]
    print(f"\n{len(ok)} of {len(results)} model types with a base_model_tp_plan load at tp {args.tp_size} "
          f"(meta device): {', '.join(ok)}")


if __name__ == "__main__":
    main()
