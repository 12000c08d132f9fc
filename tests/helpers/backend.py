"""What the transformers backend's tests share: the tiny configs of the families issue 34 names, for the context- and
pipeline-parallel tests (test_hf_context_parallel.py, test_hf_pipeline.py: each family with what makes it differ: a
parallel block, a scaled embedding, sliding windows, MoE, latent attention, chunked attention with NoPE layers,
attention sinks, soft-capping, a hybrid of gated DeltaNet and attention), the checkpoints transformers writes from
them and the one-process reference (the backend on one process, fp64); and the styles' tiny config with its
comparison against one process (test_hf_styles.py, test_hf_survey_types.py)."""
from __future__ import annotations

import torch

from tests.helpers.batches import batch
from tests.helpers.checkpoints import TransformersCheckpoints
from tests.helpers.compare import full_grads, full_params
from tests.helpers.configs import F64

# ------------------------------------------------------------------ context and pipeline parallelism

AXES_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                 pad_token_id=0, moe_intermediate_size=16, num_experts=4, num_local_experts=4, n_routed_experts=4,
                 num_experts_per_tok=2, output_router_logits=False)
AXES_FAMILIES = {
    "gpt_neox": {},  # parallel attention and MLP, partial rotary, a fused qkv the checkpoint stores per head
    "starcoder2": dict(sliding_window=5),  # LayerNorm with biases, a window shorter than the packed documents
    "cohere": {},  # parallel block, logit scale
    "gemma": dict(tie_word_embeddings=True),  # scaled embedding, (1 + w) norms, tied head
    "cohere2": dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"]),
    "granitemoe": dict(embedding_multiplier=2.0, residual_multiplier=0.5),  # MoE, scaled embedding and residuals
    "deepseek_v2": dict(num_key_value_heads=4, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                        kv_lora_rank=16, q_lora_rank=16, first_k_dense_replace=1, n_group=1, topk_group=1),
    # chunked attention on its rope layer, a NoPE layer whose query temperature grows with the token index
    "llama4_text": dict(attention_chunk_size=5, no_rope_layers=[1, 0], floor_scale=2, attn_scale=0.5),
    "gemma2": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=5.0,
                   final_logit_softcapping=5.0),  # soft-capped scores
    "granite_swa": dict(sliding_window=4, layer_types=["full_attention", "sliding_attention"]),  # attention sinks
}
# a hybrid: gated DeltaNet (a recurrence over the sequence) and attention layers
HYBRID = {"qwen3_next": dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                             shared_expert_intermediate_size=16, decoder_sparse_step=1)}
AXES_TYPES = (*AXES_FAMILIES, *HYBRID)  # every type of the backend's cp and pp tests


def axes_config(model_type: str):
    import transformers
    return transformers.AutoConfig.for_model(model_type, **{**AXES_TINY, **{**AXES_FAMILIES, **HYBRID}[model_type]})


class _AxesCheckpoints(TransformersCheckpoints):
    """The directories as strings."""

    def write_one(self, index, name, directory) -> str:
        return str(super().write_one(index, name, directory))


# {model_type: directory} of a random checkpoint of each type, written by transformers' save_pretrained
AXES_CHECKPOINTS = _AxesCheckpoints({t: (t, {**AXES_TINY, **{**AXES_FAMILIES, **HYBRID}[t]}) for t in AXES_TYPES})


def one_process(path: str):
    """The backend on one process in fp64, train mode (its experts through the per-expert loop: no fp64 kernel)."""
    from tptrain import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, backend="transformers").train()
    eager_experts(model)
    return model


def eager_experts(model) -> None:
    if hasattr(model.hf_model, "set_experts_implementation"):
        model.hf_model.set_experts_implementation("eager")


# ------------------------------------------------------------------ the styles (test_hf_styles.py,
# test_hf_survey_types.py)

STYLES_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                   pad_token_id=0, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# transformers' norms compute in fp32 even in an fp64 model: a TP sum in another order moves results by ~1e-7
STYLES_TOL = dict(rtol=1e-6, atol=1e-6)
STYLES_STEP_TOL = dict(rtol=1e-5, atol=1e-5)  # AdamW's 1/sqrt(v) turns that rounding into ~1e-5 of a step of 1e-2


def trains_like_one_process(model, ref, what: str) -> None:
    """Gradients of every parameter and 3 AdamW steps of the TP `model` equal the single-process `ref`."""
    ids, labels = batch(seed=2)
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        ref_loss, loss = ref(ids, labels=labels).loss, model(ids, labels=labels).loss
        torch.testing.assert_close(loss, ref_loss, **STYLES_TOL, msg=lambda m: f"{what} loss, step {step}: {m}")
        ref_loss.backward(), loss.backward()
        if step == 0:
            grads = full_grads(model)
            for n, p in ref.named_parameters():
                torch.testing.assert_close(grads[n], p.grad, **STYLES_TOL, msg=lambda m: f"{what} grad of {n}: {m}")
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    params = full_params(model)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(params[n], p.detach(), **STYLES_STEP_TOL,
                                   msg=lambda m: f"{what} {n} after 3 steps: {m}")
