"""What the context-parallel tests share: tiny configs of the families they cover (each with a sliding window, a
rotary variant or a norm of its own), a packed batch longer than the windows, and the checkpoints."""
from __future__ import annotations

import torch

from tests.deepseek_utils import DEEPSEEK_TINY
from tptrain.models import AutoConfig, AutoModelForCausalLM

F64 = torch.float64
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
SEQ = 16  # 2 x cp chunks at cp 2 and cp 4


def write_checkpoints(root) -> dict[str, str]:
    """{model_type: directory} of a seeded fp64 checkpoint of every family (tptrain's save_pretrained, HF format)."""
    out = {}
    for i, (model_type, kw) in enumerate({**CP_FAMILIES, **SOFTCAP}.items()):
        torch.manual_seed(i)
        config = type(AutoConfig.for_model(model_type)).from_dict({"model_type": model_type, **kw})
        model = AutoModelForCausalLM.from_config(config, dtype=F64)
        with torch.no_grad():  # norms away from 1 and biases away from 0: every parameter matters
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        out[model_type] = str(root / model_type)
        model.save_pretrained(out[model_type])
    return out


def packed_batch(seed: int = 0, seq: int = SEQ, *, packed: bool = True) -> dict[str, torch.Tensor]:
    """Two rows of packed documents (position ids restarting inside each row; every document longer than the
    windows), each document's first label -100 as packing makes them, and a few more -100. `packed=False`: one
    document per row, no position ids (plain causal attention)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CP_TINY["vocab_size"], (2, seq), generator=g)
    lengths = ([7, seq - 7], [5, 6, seq - 11])
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    labels = ids.clone()
    labels[positions == 0] = -100
    labels[1, 2] = -100
    if not packed:
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": labels, "position_ids": positions}
