"""The small pieces the one decoder is built from: the attention masks (causal, sliding window, packed documents),
soft-capped attention, RMSNorm (with its variants as flags), the fused projection (several outputs in one
weight) and the gated MLP. Each is named after what it does, not after the family that brought it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tptrain.models.configuration import PretrainedConfig


def document_ids(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """(batch, seq) index of the packed sample each token belongs to, or None when no row is packed.

    A sample starts wherever a position id is not its predecessor's plus one (as transformers'
    `find_packed_sequence_indices`), so packed rows carry their boundaries in `position_ids` alone.
    """
    if position_ids is None or position_ids.dim() != 2:
        return None
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    starts = step != 1
    if not bool(starts[:, 1:].any()):
        return None  # every row is one sample: keep the plain causal (flash) path
    return starts.cumsum(-1)


def causal_mask(seq: int, *, device: torch.device, attention_mask: torch.Tensor | None = None,
                sliding_window: int | None = None, documents: torch.Tensor | None = None,
                query_index: torch.Tensor | None = None, key_index: torch.Tensor | None = None) -> torch.Tensor | None:
    """(batch or 1, 1, queries, keys) bool, True where a query sees a key; None = plain causal (SDPA's is_causal).

    `attention_mask` is the (batch, seq) 1/0 padding mask; `sliding_window` keeps the last that many
    keys (the query's own included), as transformers' sliding-window mask; `documents` (batch, seq, from
    `document_ids`) makes the mask block-diagonal: a token of a packed sample sees only its own sample.
    Always over the full sequence: under sequence parallelism attention runs on the gathered sequence.
    `query_index` / `key_index`: the sequence index of each row / column (default: every token in order), so that
    a mask may be some rows of the whole one with its columns in any order (context parallelism: this rank's
    queries, the keys as gathered); None still means the plain causal mask of the whole sequence, which the
    caller then applies by position (`attend`'s causal path).
    A query that sees no key at all (left padding) gets a zero output from SDPA, as in transformers.
    """
    if sliding_window is not None and sliding_window >= seq:
        sliding_window = None  # the window holds the whole sequence: keep SDPA's is_causal (flash) path
    if attention_mask is None and sliding_window is None and documents is None:
        return None
    query = (torch.arange(seq, device=device) if query_index is None else query_index)[:, None]
    key = (torch.arange(seq, device=device) if key_index is None else key_index)[None, :]
    sees = key <= query
    if sliding_window is not None:
        sees = sees & (key > query - sliding_window)
    sees = sees[None, None]
    if documents is not None:  # (batch, 1, queries, keys): same sample only
        sees = sees & (documents[:, None, query[:, 0], None] == documents[:, None, None, key[0]])
    return sees if attention_mask is None else sees & attention_mask.bool()[:, None, None, key[0]]


def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x if factor == 1.0 else x * factor


def offset(x: torch.Tensor, offset: float) -> torch.Tensor:
    return x + offset if offset else x


def tanh_softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """tanh(x / cap) * cap: x squashed smoothly into (-cap, cap); None = x unchanged."""
    return x if cap is None else torch.tanh(x / cap) * cap


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
         scale: float | None, enable_gqa: bool = False) -> torch.Tensor:
    """SDPA of q (batch, heads, queries, qk dim) against k (batch, heads, keys, qk dim) and v (batch, heads, keys,
    v dim); mask (batch or 1, 1, queries, keys) bool, or None: plain causal, the queries at the last `queries` of the
    keys' positions (context parallelism's chunks against the keys up to their end), with no mask materialised.
    `enable_gqa`: k and v hold fewer heads, each shared by a group of consecutive query heads (SDPA's own)."""
    if mask is None and q.shape[2] != k.shape[2]:
        if q.device.type == "cpu":
            return _causal_at_the_end(q, k, v, scale, enable_gqa)
        # imported here: torch.nn.attention.bias imports torch._dynamo (~1 s of every process's start-up)
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                          enable_gqa=enable_gqa)


def _causal_at_the_end(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                       enable_gqa: bool) -> torch.Tensor:
    """Queries at the last positions of longer keys, causal. On CPU, SDPA's flash kernel takes only top-left causal
    (a lower-right bias falls back to the math path, which keeps a (queries x keys) score matrix for backward):
    zero queries in front make the shapes square, so the kernel runs with memory linear in the keys; their outputs
    are dropped (no gradient reaches k or v through them). More arithmetic, less memory: what long sequences need."""
    front = k.shape[2] - q.shape[2]
    padded = F.pad(q, (0, 0, front, 0))
    return F.scaled_dot_product_attention(padded, k, v, is_causal=True, scale=scale,
                                          enable_gqa=enable_gqa)[:, :, front:]


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                         scale: float | None, softcap: float) -> torch.Tensor:
    """Attention whose scores are soft-capped before the softmax (SDPA cannot), as transformers' eager attention:
    masked scores at the dtype's minimum, softmax in fp32 (or wider). q, k, v: (batch, heads, seq, head_dim)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = tanh_softcap(torch.matmul(q, k.transpose(-1, -2)) * scale, softcap)  # (batch, heads, queries, keys)
    if mask is None:  # plain causal, the queries being the last keys' positions
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
    return torch.matmul(probs, v)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, *, eps: float, scale_in_float32: bool = False, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - weight_offset))
        self.eps = eps
        self.scale_in_float32 = scale_in_float32
        self.weight_offset = weight_offset  # scale by (weight_offset + weight): Gemma's weights are offsets from 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, scale in the input dtype (transformers' LlamaRMSNorm, bit for bit), or scale in fp32,
        # then cast (`scale_in_float32`: Olmo2RMSNorm; Gemma's (1 + weight), the offset added in fp32).
        h = x.to(torch.promote_types(x.dtype, torch.float32))  # fp64 stays fp64 (exact tests)
        h = h * torch.rsqrt(self.mean_square(h) + self.eps)
        if self.scale_in_float32:
            weight = self.weight.to(h.dtype) + self.weight_offset if self.weight_offset else self.weight
            return (weight * h).to(x.dtype)
        return offset(self.weight, self.weight_offset) * h.to(x.dtype)

    def mean_square(self, h: torch.Tensor) -> torch.Tensor:
        """(..., dim) -> (..., 1). The TP style `distributed_rmsnorm` replaces it when dim is split over ranks."""
        return h.pow(2).mean(-1, keepdim=True)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def rms_norm(config: PretrainedConfig, dim: int) -> RMSNorm:
    """The config's RMSNorm over `dim` features."""
    return RMSNorm(dim, eps=config.rms_norm_eps, scale_in_float32=config.norm_scale_in_float32,
                   weight_offset=config.norm_weight_offset)


class FusedLinear(nn.Linear):
    """An nn.Linear whose output rows are several projections fused one after another (Phi-3's qkv_proj:
    q, k, v). `tp_segments` declares them as data, ((rows, holds KV heads), ...), for the `fused_colwise`
    style; `segment_sizes` is how many of each this module's rows hold (the style sets this rank's)."""

    def __init__(self, in_features: int, segments: tuple[tuple[int, bool], ...], *, bias: bool) -> None:
        super().__init__(in_features, sum(rows for rows, _ in segments), bias=bias)
        self.tp_segments = tuple(segments)
        self.segment_sizes = tuple(rows for rows, _ in segments)


def split_fused(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`module`'s output on `x`, split into its fused segments (batch, seq, local rows of each)."""
    return module(x).split(list(module.segment_sizes), dim=-1)


class HeadGradient:
    """One forward's meeting point of a tied weight's two gradients (`tie_word_embeddings`): the output head's,
    parked by `head_weight`'s backward, and the embedding's rows, which `Embedding`'s backward adds into it. The
    weight then gets one gradient, the head's with the rows added, instead of the head's plus a dense
    (vocab, hidden) embedding gradient summed into it (a second vocab-sized tensor, its zero fill and the sum)."""

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None  # the head's gradient, between the two backwards
        self.embedding_done = False  # the embedding's backward ran (then the head's gradient goes on as usual)

    def head_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` for the head to read (a view): its gradient is parked here for the embedding's backward."""
        return _ParkHeadGradient.apply(weight, self)


class _ParkHeadGradient(torch.autograd.Function):
    """identity (a view) fwd / the gradient parked in the HeadGradient bwd (passed on if the embedding ran first)."""

    @staticmethod
    def forward(ctx, weight, meeting):
        ctx.meeting = meeting
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        meeting = ctx.meeting
        if meeting.embedding_done:  # not the usual order (the head's backward comes first): the plain sum instead
            return grad, None
        assert meeting.grad is None, "one head weight per HeadGradient"
        meeting.grad = grad
        return None, None


class _TiedEmbedding(torch.autograd.Function):
    """F.embedding fwd / bwd: the rows' gradients added into the head's parked gradient, which becomes the weight's
    (the embedding's dense gradient where none was parked). The rows are summed per distinct id first, from zero and
    in token order as `embedding_dense_backward` sums them, then each sum added once: the same floats as the dense
    gradient added to the head's. `torch.unique` (a host sync on an accelerator) runs once, at backward's end."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, meeting):
        ctx.save_for_backward(ids)
        ctx.rows, ctx.padding_idx, ctx.meeting = weight.shape[0], padding_idx, meeting
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,), meeting = ctx.saved_tensors, ctx.meeting
        grad, meeting.grad, meeting.embedding_done = meeting.grad, None, True
        pad = -1 if ctx.padding_idx is None else ctx.padding_idx
        if grad is None:
            return None, torch.ops.aten.embedding_dense_backward(grad_out, ids, ctx.rows, pad, False), None, None
        ids, rows = ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1])
        if pad >= 0:  # the padding row gets no gradient from the embedding, as in nn.Embedding
            counted = ids != pad
            ids, rows = ids[counted], rows[counted]
        distinct, inverse = torch.unique(ids, return_inverse=True)
        sums = rows.new_zeros(distinct.shape[0], rows.shape[1]).index_add_(0, inverse, rows)
        return None, grad.index_add_(0, distinct, sums.to(grad.dtype)), None, None


class Embedding(nn.Embedding):
    """nn.Embedding whose weight gradient can meet the tied output head's (`HeadGradient`): while `head_gradient`
    is set (by the causal LM, around one forward), its backward adds its rows into the head's gradient."""

    head_gradient: HeadGradient | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        meeting = self.head_gradient
        if meeting is None or self.max_norm is not None or self.scale_grad_by_freq or self.sparse:
            return super().forward(ids)
        return _TiedEmbedding.apply(ids, self.weight, self.padding_idx, meeting)


class MLP(nn.Module):
    tp_pairs = {"down_proj": ("gate_proj", "up_proj")}  # see decoder.Attention

    def __init__(self, config: PretrainedConfig, *, inner: int | None = None) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, inner or config.intermediate_size
        self.fused = config.fused_projections
        if self.fused:  # one gate_up_proj: gate rows, then up rows
            self.gate_up_proj = FusedLinear(hidden, ((inner, False), (inner, False)), bias=config.mlp_bias)
            self.tp_pairs = {"down_proj": ("gate_up_proj",)}
        else:
            self.gate_proj = nn.Linear(hidden, inner, bias=config.mlp_bias)
            self.up_proj = nn.Linear(hidden, inner, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inner, hidden, bias=config.mlp_bias)
        self.gelu_tanh = config.mlp_activation == "gelu_pytorch_tanh"  # else SiLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = split_fused(self.gate_up_proj, x) if self.fused else (self.gate_proj(x), self.up_proj(x))
        gate = F.gelu(gate, approximate="tanh") if self.gelu_tanh else F.silu(gate)
        return self.down_proj(gate * up)
