"""The tiny configs several test files build models from: tensor parallelism's, the Trainer's, each model family's
(test_family_cli.py trains every one with `tptrain train`), the mixtures of experts', DeepSeek-V3's, context
parallelism's, and a ~150 MB Qwen3 for the memory tests."""
from __future__ import annotations

import torch

from tptrain.models import AutoConfig

F64 = torch.float64
VOCAB = 128  # the families' vocabulary (tests.helpers.batches.batch)

# ------------------------------------------------------------------ tensor parallelism (test_tensor_parallel.py, ...)

TP_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
CONFIGS = {
    "qwen3": dict(model_type="qwen3", **TP_TINY),
    "qwen2": dict(model_type="qwen2", **{**TP_TINY, "head_dim": 16}),
    "llama_tied_llama3_rope": dict(model_type="llama", tie_word_embeddings=True,
                                   **{**TP_TINY, "num_key_value_heads": 4},
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen3_one_kv_head": dict(model_type="qwen3", **{**TP_TINY, "num_key_value_heads": 1}),
}


def make_config(name: str):
    kw = dict(CONFIGS[name])
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


# ------------------------------------------------------------------ the Trainer (tests.helpers.trainer)

# Qwen3: q/k norms are partial-gradient parameters; at tp 4 the 2 KV heads are shared by 2 ranks each.
TRAINER_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=64)

# test_moe_training.py: top-1 of 4 experts: at 2 ranks expert parallelism dispatches by all-to-all; the aux loss is on.
MOE_TRAIN_TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=64, num_experts=4, num_experts_per_tok=1, output_router_logits=True,
                      router_aux_loss_coef=0.05)

# ------------------------------------------------------------------ pipeline parallelism (checkpoints.save_family)

PIPELINE_LAYERS = 4
PIPELINE_FAMILIES = {  # one tied (the bundled Qwen3's layout), one untied, one MoE
    "qwen3_tied": ("qwen3", dict(TRAINER_TINY, tie_word_embeddings=True, num_hidden_layers=PIPELINE_LAYERS)),
    "llama": ("llama", dict(TRAINER_TINY, num_hidden_layers=PIPELINE_LAYERS)),
    "llama8": ("llama", dict(TRAINER_TINY, num_hidden_layers=8)),  # two stages per rank at pp 4
    "qwen3_moe": ("qwen3_moe", dict(MOE_TRAIN_TINY, num_experts_per_tok=2, output_router_logits=False,
                                    num_hidden_layers=PIPELINE_LAYERS)),
}

# ------------------------------------------------------------------ the families

# test_families_simple.py
SIMPLE_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   max_position_embeddings=256, num_attention_heads=4,
                   num_key_value_heads=2)  # 2 KV heads: replicated twice at tp 4
SIMPLE_FAMILIES = {
    # a window of 5 < the batch's 12 keys, head_dim 24 != hidden / heads
    "mistral": dict(SIMPLE_TINY, head_dim=24, sliding_window=5),
    # one sliding layer, one full layer
    "ministral": dict(SIMPLE_TINY, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    # YaRN (both mscales, so cos and sin are scaled too) and queries scaled past position 6 (Llama 4 temperature);
    # sliding_window applies to every layer, as in Mistral
    "ministral3": dict(SIMPLE_TINY, head_dim=16, sliding_window=5, max_position_embeddings=24, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=6, beta_fast=8.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=0.5, llama_4_scaling_beta=0.3)),
    # every multiplier away from 1, attention bias, tied embeddings
    "granite": dict(SIMPLE_TINY, embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.1,
                    logits_scaling=4.0, attention_bias=True, tie_word_embeddings=True),
    # layer 1 without RoPE
    "smollm3": dict(SIMPLE_TINY, no_rope_layers=[1, 0], pad_token_id=None, bos_token_id=1, eos_token_id=2),
}

# test_family_gemma.py
GEMMA_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, max_position_embeddings=64, sliding_window=4,
                  query_pre_attn_scalar=20, layer_types=["sliding_attention", "full_attention"] * 2)
GEMMA_FAMILIES = {
    "gemma2": dict(GEMMA_TINY, attn_logit_softcapping=5.0, final_logit_softcapping=5.0),
    "gemma3_text": dict(GEMMA_TINY, final_logit_softcapping=5.0, rope_theta=1e5, rope_local_base_freq=100.0,
                        rope_scaling={"rope_type": "linear", "factor": 2.0}),
}

# test_family_phi3.py
PHI3_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, eos_token_id=2, bos_token_id=1, pad_token_id=0,
                 partial_rotary_factor=0.5)

# test_family_olmo2.py
OLMO2_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, eos_token_id=2)

# test_family_olmo3.py
OLMO3_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
OLMO3_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, eos_token_id=2, sliding_window=4,
                  layer_types=OLMO3_LAYER_TYPES)
OLMO3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
              "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}

# test_moe.py, test_moe_ep.py
MOE_TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_experts_per_tok=2, output_router_logits=True, eos_token_id=2,
                pad_token_id=0)
MOE_FAMILIES = {  # model_type: (transformers class names, family keys)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=16, head_dim=16, mlp_only_layers=[1], norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4)),
}

# test_family_deepseek.py, test_deepseek_training.py: MLA with low-rank q (q_lora_rank; None: one q_proj), YaRN with
# both mscales (the softmax scale changes too), 8 experts in 4 groups of which each token sees 2, top-2, one shared
# expert, the first layer dense.
DEEPSEEK_TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                     n_routed_experts=8, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
                     qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                     max_position_embeddings=256, eos_token_id=2, pad_token_id=0,
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "mscale": 1.0, "mscale_all_dim": 0.707, "rope_theta": 10000.0})

# ------------------------------------------------------------------ context parallelism (test_context_parallel.py,
# test_compose_moe.py): each family with a sliding window, a rotary variant or a norm of its own

CP_TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64)
CP_FAMILIES = {
    "qwen3": dict(CP_TINY, head_dim=8),  # per-head q/k norms
    "mistral": dict(CP_TINY, head_dim=8, sliding_window=3),  # a window shorter than every packed document
    "gemma3_text": dict(CP_TINY, head_dim=8, sliding_window=4, query_pre_attn_scalar=8, rope_theta=1e5,
                        rope_local_base_freq=100.0, layer_types=["sliding_attention", "full_attention"],
                        final_logit_softcapping=5.0),  # per-layer rotary bases
    "olmo2": dict(CP_TINY),  # q/k norms over the whole projected width (distributed over TP)
    "phi3": dict(CP_TINY, partial_rotary_factor=0.5, pad_token_id=0),  # fused qkv / gate_up, partial rotary
    "qwen3_moe": dict(CP_TINY, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      norm_topk_prob=True, output_router_logits=False),
    # MLA: values narrower than keys (v_head_dim 12, qk 8 + 8), the RoPE key shared by the heads, YaRN; group-limited
    # routing of each rank's own tokens
    "deepseek_v3": dict(DEEPSEEK_TINY, vocab_size=CP_TINY["vocab_size"]),
}
# Soft-capped scores, checked on unpacked rows: attention then takes no mask at all under cp, causal at the end (the
# window is longer than the rows)
SOFTCAP = {"gemma2": dict(CP_TINY, head_dim=8, sliding_window=64, query_pre_attn_scalar=8,
                          attn_logit_softcapping=5.0, final_logit_softcapping=5.0)}

# ------------------------------------------------------------------ private memory (test_checkpoint_memory.py,
# test_save_pretrained_stream.py)

# A ~150 MB fp32 Qwen3.
BIG = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=16,
           num_key_value_heads=4, head_dim=64, max_position_embeddings=64)
