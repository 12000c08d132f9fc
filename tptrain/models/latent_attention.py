"""Multi-head latent attention (MLA, DeepSeek-V2/V3): queries from a low-rank latent (or one q_proj), keys and values
from one shared low-rank latent, and RoPE on a decoupled slice of each head (one RoPE key shared by all heads).

Single-device code with transformers' parameter names (DeepseekV3Attention). Under tensor parallelism the per-head
projections (q_b_proj or q_proj, kv_b_proj) are split by heads and o_proj by its input; the latents are computed
whole on every rank (kv_a_proj_with_mqa's RoPE key, read by every head, through the 'mla_kv_a_proj' style). Head
counts and lengths come from the tensor shapes, never from the config or from x: under sequence parallelism x is a
sequence shard, the latents are computed on it (per token), the per-head projections gather them, and the shared RoPE
key is gathered where it leaves the latent path (`rope_key`, a named point the plan's 'sequence_gather' hooks; as
Megatron-Core's MLA does). Under context parallelism `attend` sees every rank's keys and values: each head's K
(qk_nope_head_dim + qk_rope_head_dim) and V (v_head_dim), gathered together. Its KV cache is the compressed one: per
position the normalised latent (kv_lora_rank) and the rotated RoPE key (qk_rope_head_dim), the same on every TP rank;
each step projects every cached latent to this rank's heads' keys and values again (kv_b_proj).
"""
from __future__ import annotations

import torch
from torch import nn

from tptrain.models.cache import LayerCache
from tptrain.models.configuration import PretrainedConfig
from tptrain.models.layers import rms_norm, sdpa
from tptrain.models.rope import apply_rotary, deinterleave


class LatentAttention(nn.Module):
    # The plan check's facts (parallel/contract.py): split by heads, kv_b_proj's rows are the key/value heads
    # (num_key_value_heads == num_attention_heads: never replicated); o_proj reads the per-head projections; each
    # per-head projection reads the latent norm before it, which has no rule (whole on every rank).
    tp_kv_projections = ("kv_b_proj",)
    tp_pairs = {"o_proj": ("q_proj", "q_b_proj", "kv_b_proj"), "q_b_proj": ("q_a_layernorm",),
                "kv_b_proj": ("kv_a_layernorm",), "q_a_layernorm": ("q_a_proj",),
                "kv_a_layernorm": ("kv_a_proj_with_mqa",)}

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.scale = config.attention_scale
        self.interleaved = config.rope_interleave
        q_rows, bias = heads * (self.nope_dim + self.rope_dim), config.attention_bias
        self.low_rank_q = config.q_lora_rank is not None
        if self.low_rank_q:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = rms_norm(config, config.q_lora_rank)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_rows, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, q_rows, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_rank + self.rope_dim, bias=bias)
        # Its last rope_dim features, the RoPE key, are read by every head: 'mla_kv_a_proj' sums their gradient.
        self.kv_a_proj_with_mqa.tp_replicated_tail = self.rope_dim
        self.kv_a_layernorm = rms_norm(config, self.kv_rank)
        self.rope_key = nn.Identity()  # where the shared RoPE key (batch, seq, rope dim) leaves the latent path
        self.rope_key.tp_replicated_tail = self.rope_dim  # all of its features read whole by every head
        self.kv_b_proj = nn.Linear(self.kv_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                q_scale: torch.Tensor | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        assert q_scale is None, "query_position_scale is not a DeepSeek-V3 option"
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.low_rank_q else self.q_proj(x)
        b, s = q.shape[:2]  # the whole sequence (x may be a sequence shard)
        q = q.view(b, s, -1, self.nope_dim + self.rope_dim).transpose(1, 2)  # (batch, local heads, seq, qk dim)
        q_pass, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # (batch, seq, kv rank)
        k_rot = self.rope_key(k_rot).view(b, 1, s, self.rope_dim)  # one RoPE key for every head
        if self.interleaved:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q_rot, k_rot = apply_rotary(q_rot, k_rot, cos, sin)
        if cache is not None:  # the compressed cache: every position's latent and rotated RoPE key, these appended
            latent, k_rot = cache.update(latent, k_rot)
        kv = self.kv_b_proj(latent)  # (batch, keys: the cached positions and these, local heads x (nope + v dim))
        kv = kv.view(b, kv.shape[1], -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_pass, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # (batch, local heads, keys, each dim)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(-1, k_pass.shape[1], -1, -1)), dim=-1)
        out = self.attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))  # (batch, seq, local heads * v dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q, k (batch, heads, queries / keys, qk dim) after RoPE (k's RoPE part expanded to every head), v (batch,
        heads, keys, v dim), mask as `Attention.attend`'s (None: causal, the queries at the end of the keys) ->
        (batch, heads, queries, v dim). Context parallelism wraps it to gather every rank's keys and values."""
        return sdpa(q, k, v, mask, scale=self.scale)
