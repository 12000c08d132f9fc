"""What the transformers backend's context- and pipeline-parallel tests share (test_hf_context_parallel.py,
test_hf_pipeline.py): tiny configs of the families issue 34 names (each with what makes it differ: a parallel block,
a scaled embedding, sliding windows, MoE, latent attention, chunked attention with NoPE layers, attention sinks,
soft-capping, a hybrid of gated DeltaNet and attention), checkpoints transformers writes from them, and the
one-process reference (the backend on one process, fp64)."""
from __future__ import annotations

from functools import partial

import torch

from tests.family_utils import random_checkpoint

F64 = torch.float64
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, moe_intermediate_size=16, num_experts=4, num_local_experts=4, n_routed_experts=4,
            num_experts_per_tok=2, output_router_logits=False)
FAMILIES = {
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
TYPES = (*FAMILIES, *HYBRID)  # every type of the backend's cp and pp tests


def config(model_type: str):
    import transformers
    return transformers.AutoConfig.for_model(model_type, **{**TINY, **{**FAMILIES, **HYBRID}[model_type]})


def write_checkpoints(tmp_path_factory, types) -> dict[str, str]:
    """{model_type: directory} of a random checkpoint of each type, written by transformers' save_pretrained."""
    import transformers
    return {t: str(random_checkpoint(tmp_path_factory, t, partial(transformers.AutoModelForCausalLM.from_config,
                                                                 config(t)))[0]) for t in types}


def one_process(path: str):
    """The backend on one process in fp64, train mode (its experts through the per-expert loop: no fp64 kernel)."""
    from tptrain import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, backend="transformers").train()
    eager_experts(model)
    return model


def eager_experts(model) -> None:
    if hasattr(model.hf_model, "set_experts_implementation"):
        model.hf_model.set_experts_implementation("eager")
