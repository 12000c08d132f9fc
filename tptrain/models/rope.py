"""Rotary position embeddings, with the inverse frequencies computed exactly as transformers does.

Nothing here is a parameter or buffer: the model is built on the meta device and materialised from
the checkpoint, so the (tiny) inverse-frequency vector is computed on CPU at construction and kept
as a plain attribute, copied once per device it is used on.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from tptrain.models.configuration import PretrainedConfig, rope_type_of


def rope_inv_freq(config: PretrainedConfig, layer: int = 0, *, long: bool = False) -> torch.Tensor:
    """Inverse frequencies of `layer`'s RoPE (`config.layer_ropes`), (rotary_dim // 2,) fp32 on CPU, for rope type
    "default", "linear", "llama3", "yarn" or "longrope" (`long`: its long-context factors, else its short ones)."""
    theta, scaling = config.layer_ropes[layer]
    dim = config.rotary_dim
    # Explicit device/dtype: construction may run under `torch.device("meta")` or a bf16 default dtype.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    rope_type = rope_type_of(scaling)
    if rope_type == "longrope":  # transformers' `_compute_longrope_parameters`
        factors = scaling["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * theta ** exponents)
    if rope_type == "yarn":
        return _yarn_inv_freq(theta ** exponents, scaling, _yarn_factor(config, scaling), theta=theta, dim=dim)
    inv_freq = 1.0 / (theta ** exponents)
    if rope_type == "linear":  # positions divided by `factor`
        inv_freq = inv_freq / scaling["factor"]
    if rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, scaling, config.max_position_embeddings)
    return inv_freq


def longrope_original_length(config: PretrainedConfig) -> int | None:
    """The pre-training context of a longrope model: past it the long factors apply. transformers prefers the
    config's top-level `original_max_position_embeddings` to the one inside `rope_scaling`."""
    top = getattr(config, "original_max_position_embeddings", None) or config.extra.get(
        "original_max_position_embeddings")
    return top or (config.rope_scaling or {}).get("original_max_position_embeddings")


def rope_attention_factor(config: PretrainedConfig) -> float:
    """Factor on cos and sin: 1 except for longrope, sqrt(1 + log(factor) / log(original length)), and YaRN."""
    if config.rope_type == "yarn":
        return _yarn_attention_factor(config.rope_scaling, _yarn_factor(config, config.rope_scaling))
    if config.rope_type != "longrope":
        return 1.0
    scaling, original = config.rope_scaling, longrope_original_length(config)
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor = scaling.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_scaling(inv_freq: torch.Tensor, scaling: dict, max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling (transformers' `_compute_llama3_parameters`)."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling.get("original_max_position_embeddings", max_position_embeddings)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_factor(config: PretrainedConfig, scaling: dict) -> float:
    """YaRN's context extension; without `factor`, max_position_embeddings over the original length (DeepSeek-V3)."""
    factor = scaling.get("factor")
    return config.max_position_embeddings / scaling["original_max_position_embeddings"] if factor is None else factor


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_attention_factor(scaling: dict, factor: float) -> float:
    """transformers' `_compute_yarn_parameters`: `attention_factor`, else the ratio of the two mscales, else
    0.1 * log(factor) + 1."""
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_inv_freq(powers: torch.Tensor, scaling: dict, factor: float, *, theta: float,
                   dim: int) -> torch.Tensor:
    """YaRN (NTK-by-parts) from `powers` = theta ** (2i / dim), (dim // 2,): frequencies that turn fewer than
    `beta_slow` times over the original context are interpolated (divided by `factor`), those turning more than
    `beta_fast` times are kept, a linear ramp between."""
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the feature index that turns `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    return 1.0 / (factor * powers) * (1 - extrapolation) + 1.0 / powers * extrapolation


class RotaryEmbedding(nn.Module):
    """position_ids -> (cos, sin) of one layer's RoPE, each (batch or 1, seq, rotary_dim), in the activations'
    dtype (at least fp32 with `config.rope_in_float32`, so that q and k are rotated in fp32). Layers may differ
    in RoPE base and scaling (`config.layer_ropes`, Gemma 3); `layer_rope[i]` is the first layer with layer i's
    RoPE. longrope (Phi-3; one RoPE for every layer) switches to its long factors past the pre-training context
    and scales cos and sin by its attention factor."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.in_float32 = config.rope_in_float32
        ropes = config.layer_ropes
        self.layer_rope = [ropes.index(rope) for rope in ropes]
        self.attention_factor = rope_attention_factor(config)
        # longrope: the long factors apply to the whole sequence once it is longer than the pre-training context
        self.original_length = longrope_original_length(config) if config.rope_type == "longrope" else None
        cpu = torch.device("cpu")
        # {(first layer with that RoPE, "short" / "long", device): (rotary_dim // 2,) fp32 inverse frequencies}
        self._inv_freq: dict[tuple[int, str, torch.device], torch.Tensor] = {}
        for i in sorted(set(self.layer_rope)):
            self._inv_freq[i, "short", cpu] = rope_inv_freq(config, i)
            if self.original_length is not None:
                self._inv_freq[i, "long", cpu] = rope_inv_freq(config, i, long=True)

    def _inv_freq_on(self, rope: int, kind: str, device: torch.device) -> torch.Tensor:
        if (rope, kind, device) not in self._inv_freq:
            self._inv_freq[rope, kind, device] = self._inv_freq[rope, kind, torch.device("cpu")].to(device)
        return self._inv_freq[rope, kind, device]

    def long_context(self, position_ids: torch.Tensor) -> torch.Tensor | None:
        """Whether longrope's long factors apply: the batch's longest position past the pre-training context (a
        tensor condition, as transformers: no host sync); None without longrope. Context parallelism replaces it on
        the instance to read the whole batch's positions (a rank holds chunks of the sequence)."""
        if self.original_length is None:
            return None
        return position_ids.max() + 1 > self.original_length

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        rope = self.layer_rope[layer]
        inv_freq = self._inv_freq_on(rope, "short", position_ids.device)
        longer = self.long_context(position_ids)
        if longer is not None:
            inv_freq = torch.where(longer, self._inv_freq_on(rope, "long", position_ids.device), inv_freq)
        freqs = position_ids[..., None].float() * inv_freq  # (batch, seq, rotary_dim // 2), fp32
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        dtype = torch.promote_types(x.dtype, torch.float32) if self.in_float32 else x.dtype
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 keep_dtype: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (batch, heads, seq, head_dim) and k (batch, kv_heads, seq, head_dim). `keep_dtype`: return them
    in their own dtype when cos/sin are wider (`rope_in_float32`: rotated in fp32, as transformers' OLMo 2).
    cos/sin narrower than head_dim (partial rotary): only the leading features rotate, the rest pass through."""
    rot = cos.shape[-1]
    if rot < q.shape[-1]:
        (q, q_pass), (k, k_pass) = q.split([rot, q.shape[-1] - rot], -1), k.split([rot, k.shape[-1] - rot], -1)
        q, k = apply_rotary(q, k, cos, sin, keep_dtype=keep_dtype)
        return torch.cat([q, q_pass], dim=-1), torch.cat([k, k_pass], dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    q_rot, k_rot = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    return (q_rot.to(q.dtype), k_rot.to(k.dtype)) if keep_dtype else (q_rot, k_rot)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., d) features paired as (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...), the halves `apply_rotary`
    rotates. DeepSeek's RoPE pairs neighbours (`rope_interleave`): rotating the de-interleaved features is
    transformers' `apply_rotary_pos_emb_interleave`, bit for bit (it returns them in this order too)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
