"""What the DeepSeek-V3 tests share (test_family_deepseek.py, test_deepseek_training.py): the tiny config and a
checkpoint transformers writes from it."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.family_utils import VOCAB, randomize

# MLA with low-rank q (q_lora_rank; None: one q_proj), YaRN with both mscales (the softmax scale changes too), 8 experts
# in 4 groups of which each token sees 2, top-2, one shared expert, the first layer dense.
DEEPSEEK_TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                     n_routed_experts=8, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
                     qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                     max_position_embeddings=256, eos_token_id=2, pad_token_id=0,
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "mscale": 1.0, "mscale_all_dim": 0.707, "rope_theta": 10000.0})


def deepseek_checkpoint(directory: Path, **overrides) -> Path:
    """A tiny random DeepSeek-V3 written by transformers' save_pretrained (hub layout), every parameter random and
    the routers' e_score_correction_bias too (a buffer in transformers: randomized apart)."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**DEEPSEEK_TINY, **overrides})).eval()
    randomize(hf)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    hf.save_pretrained(directory)
    return directory
