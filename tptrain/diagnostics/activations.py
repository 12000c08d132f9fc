"""The bytes one training microbatch keeps for backward, per decoder layer, as tptrain's decoder saves them.

    work = Work(batch=2, seq=4096, tp=2, cp=1, sp=False, precision=precision(4, bf16=False, fsdp=False))
    layer_activations(shapes.layers[0], work)       # {"attention norm": bytes, "q/k/v input": bytes, ...}

Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.1) count a
layer's activations op by op: every tensor an op saves for its backward, s*b*h*(34 + 5*a*s/h) bytes for their
fp16 GPT layer with dropout and materialised attention scores. This module counts the same way for tptrain's layer
(docs/planning.md lists every term): no dropout; SDPA's fused kernels keep q, k, v, the output and one fp32
log-sum-exp per query and head instead of the (s x s) scores; grouped-query K and V are expanded to every query head
before attention where a mask or soft-capping needs it (`Attention.attend`: plain causal attention gives SDPA the KV
heads as they are); RMSNorm keeps its fp32 input, its rsqrt and its normalised input; SwiGLU keeps
gate, activation, up and their product. Tensor parallelism divides the head and MLP widths (K/V heads replicated
when tp exceeds them), sequence parallelism the tokens of the norms and of each TP region's saved input, context
parallelism the tokens (attention keeps this rank's q, K and V: its backward gathers K and V again).
"""
from __future__ import annotations

from dataclasses import dataclass

from tptrain.diagnostics.model_shapes import LayerShape, TowerShape
from tptrain.losses import chunk_tokens


@dataclass(frozen=True)
class Precision:
    """Bytes per element. param: the parameters as loaded; compute: linear outputs and attention; residual: the
    residual stream (fp32 under autocast with fp32 parameters); autocast: linear inputs and weights are cast copies
    (bf16 without FSDP2); unsharded / reduce: FSDP2's gathered parameters and its reduce-scatter (its
    MixedPrecisionPolicy: bf16 / fp32 under --bf16)."""

    param: int
    compute: int
    residual: int
    autocast: bool
    unsharded: int
    reduce: int


def precision(param_bytes: int, *, bf16: bool, fsdp: bool) -> Precision:
    """What `TrainingArguments(bf16=)` runs: FSDP2's MixedPrecisionPolicy(bf16, fp32 reduce) when the model is
    data-parallel, else autocast to bf16; without bf16, everything in the parameters' dtype."""
    if not bf16:
        return Precision(param_bytes, param_bytes, param_bytes, False, param_bytes, param_bytes)
    if fsdp:
        return Precision(param_bytes, 2, 2, False, 2, 4)
    return Precision(param_bytes, 2, param_bytes, True, param_bytes, param_bytes)


@dataclass(frozen=True)
class Work:
    """One microbatch on one rank: `batch` sequences of `seq` tokens, split over tp (widths), cp (tokens) and, for
    the norms and each TP region's saved input, sp. ep / expert_parallel: how the experts are split (over an ep
    axis, or by expert over the TP group). device: "cuda" or "cpu" (CPU's math path for latent attention)."""

    batch: int
    seq: int
    tp: int
    cp: int
    sp: bool
    precision: Precision
    ep: int = 1
    expert_parallel: bool = False
    device: str = "cuda"
    frozen_norms: bool = False  # LoRA: the norms' weights do not train

    @property
    def tokens(self) -> int:
        """Tokens this rank computes: its share of the sequence under cp."""
        return self.batch * self.seq // self.cp

    @property
    def sp_tokens(self) -> int:
        """Tokens of the residual stream on this rank (a 1/tp shard of them under sequence parallelism)."""
        return self.tokens // self.tp if self.sp else self.tokens


def norm(features: int, tokens: int, x_bytes: int, fp32_scale: bool, groups: int = 1, trained: bool = True) -> int:
    """RMSNorm (layers.RMSNorm) over `groups` x `features` per token: its input in fp32 (the input itself when fp32,
    else a copy), the rsqrt (one fp32 per group) and, for its weight's gradient (not when frozen: LoRA), the
    normalised input (cast back to the input's dtype, or kept fp32 when scaling in fp32)."""
    normalised = features * (4 if fp32_scale else x_bytes) if trained else 0
    return tokens * groups * (features * max(x_bytes, 4) + 4 + normalised)


def linear_input(features: int, tokens: int, x_bytes: int, p: Precision, readers: int = 1) -> int:
    """What the linear layers reading one input save of it: the input itself, or under autocast one bf16 copy per
    reader (autocast caches the casts of weights only: q, k and v each cast the same input)."""
    return tokens * features * (p.compute * readers if p.autocast else x_bytes)


def _heads(shape: LayerShape, tp: int) -> tuple[int, int]:
    """(query heads, key/value heads) on one TP rank (KV heads replicated when tp exceeds them)."""
    return max(1, shape.heads // tp), max(1, shape.kv_heads // tp)


def attention(shape: LayerShape, work: Work) -> dict[str, int]:
    """Attention's saved tensors past its input: q/k norms, then SDPA's q, K, V, output and log-sum-exp, or the
    soft-capped eager path's (s x s) scores; under cp only this rank's q, K and V."""
    w, c = work.tokens, work.precision.compute
    heads, kv = _heads(shape, work.tp)
    q, v_out = heads * shape.q_dim, heads * shape.v_dim
    out: dict[str, int] = {}
    fp32, trained = shape.norm_fp32, not work.frozen_norms
    if shape.qk_norm == "width":  # over the whole projected width (OLMo 2)
        out["q/k norms"] = norm(q, w, c, fp32, trained=trained) + norm(kv * shape.q_dim, w, c, fp32, trained=trained)
    elif shape.qk_norm:  # over each head (Qwen3)
        out["q/k norms"] = norm(shape.q_dim, w, c, fp32, heads, trained) + norm(shape.q_dim, w, c, fp32, kv, trained)
    if shape.latent is not None:  # MLA: the latents' norms and the inputs of q_b_proj / kv_b_proj
        out["latent norms"] = sum(norm(r, w, c, shape.norm_fp32) + w * r * c for r in shape.latent if r)
    if work.cp > 1:  # this rank's q, K and V only: backward gathers K and V again and recomputes attention; the two
        # chunks' outputs concatenated, then laid out (batch, seq, heads * v_dim) for o_proj
        out["attention"] = w * (q + kv * (shape.q_dim + shape.v_dim)) * c
        out["o_proj input"] = w * v_out * c
        return out
    # SDPA's own GQA (no expanded copy) for plain causal attention: no window mask, no soft-capping
    # (`Attention.attend`)
    native = not shape.softcap and (shape.window is None or shape.window >= work.seq)
    expanded = shape.gqa_expanded and heads > kv and not native
    k_heads = heads if expanded else kv
    if shape.softcap:  # scores, their tanh, fp32 softmax and probabilities: 8 bytes per score either way
        scores = w * work.seq * heads
        out["attention"] = w * (q + v_out) * c + w * k_heads * (shape.q_dim + shape.v_dim) * c + scores * 8
        return out
    if work.device == "cpu" and shape.q_dim != shape.v_dim:  # CPU's math path (latent attention's V is narrower):
        # q and K scaled, V, and every (query, key) probability in fp32
        out["attention"] = w * heads * (shape.q_dim + shape.v_dim) * c + work.batch * work.seq * heads * \
            shape.q_dim * c + heads * (w // work.batch) * work.batch * work.seq * 4
        return out
    out["attention"] = w * (q * c + v_out * c + heads * 4) + w * k_heads * (shape.q_dim + shape.v_dim) * c
    if shape.window is not None and shape.window < work.seq:  # SDPA keeps the boolean mask as an additive float one
        out["attention mask"] = work.seq * work.seq * c
    return out


def mlp(inner: int, tokens: int, c: int) -> int:
    """SwiGLU (or GELU-tanh gating): gate, its activation, up, and their product (down_proj's input)."""
    return 4 * tokens * inner * c


def experts(shape: LayerShape, work: Work) -> dict[str, int]:
    """The MoE block past its input: the router (fp32 probabilities, top-k ids, renormalised weights), the routed
    rows and the grouped matmuls on this rank's assignments, the shared expert."""
    moe, p, w, c = shape.moe, work.precision, work.tokens, work.precision.compute
    k, inner = moe.top_k, moe.inner
    out = {"router": w * (moe.experts * 4 + k * 8 + (k * 4 + 4 if moe.renormalise else 0))}
    if work.expert_parallel and work.tp > 1:  # whole experts, split by expert over the TP group: a 1/tp share
        rows = w * k // work.tp
    else:  # expert TP (inner split), or an ep axis: this rank's tokens' assignments, on average
        rows, inner = w * k, inner // work.tp
    # the rows (input and output in the matmuls' dtype, weighted output in the block's), the grouped matmuls, two
    # int64 indices and the weights
    out["experts"] = rows * (shape.hidden * (2 * c + p.residual) + 4 * inner * c + 16 + c)
    if moe.shared_inner:
        gate = w * (c + shape.hidden * c) if moe.gated_shared else 0
        out["shared expert"] = mlp(moe.shared_inner // work.tp, w, c) + gate
    return out


def layer_activations(shape: LayerShape, work: Work) -> dict[str, int]:
    """{what: bytes} one decoder layer keeps from its forward to its backward for one microbatch on one rank."""
    p = work.precision
    r, c, t, h, trained = p.residual, p.compute, work.sp_tokens, shape.hidden, not work.frozen_norms
    out: dict[str, int] = {}
    if shape.norms_in:
        out["attention norm"] = norm(h, t, r, shape.norm_fp32, trained=trained)
        out["q/k/v input"] = linear_input(h, t, r, p, 1 if shape.fused or shape.latent else 3)
    else:  # norms on the sublayers' outputs (OLMo 2): the projections read the residual stream itself
        out["q/k/v input"] = t * h * r
    out.update(attention(shape, work))
    if shape.norms_out:
        out["attention output norm"] = norm(h, t, c, shape.norm_fp32, trained=trained)
    if shape.norms_in:
        out["mlp norm"] = norm(h, t, r, shape.norm_fp32, trained=trained)
        out["mlp input"] = linear_input(h, t, r, p, _mlp_readers(shape))
    else:
        out["mlp input"] = t * h * r
    if shape.moe is None:
        out["mlp"] = mlp(shape.mlp_inner // work.tp, work.tokens, c)
    else:
        out.update(experts(shape, work))
    if shape.norms_out:
        out["mlp output norm"] = norm(h, t, c, shape.norm_fp32, trained=trained)
    return out


def _mlp_readers(shape: LayerShape) -> int:
    """The linear layers reading the MLP sublayer's input: gate and up (one fused gate_up), or the router, the shared
    expert's gate and up and its sigmoid gate."""
    if shape.moe is None:
        return 1 if shape.fused else 2
    return 1 + (0 if not shape.moe.shared_inner else 2 + shape.moe.gated_shared)


def checkpointed_layer(shape: LayerShape, work: Work) -> int:
    """Under activation checkpointing a layer keeps only its input (recomputing the rest in its backward)."""
    return work.sp_tokens * shape.hidden * work.precision.residual


def layer_backward_transient(shape: LayerShape, work: Work) -> int:
    """The gradients alive at once inside one layer's backward beside its saved tensors: the incoming and outgoing
    gradients of the residual stream, and three of the widest sublayer's (the MLP's gate/up/product, or SDPA's
    dq/dk/dv)."""
    c, w = work.precision.compute, work.tokens
    heads, _ = _heads(shape, work.tp)
    if shape.moe is not None:
        moe = shape.moe
        rows = w * moe.top_k // work.tp if work.expert_parallel and work.tp > 1 else w * moe.top_k
        inner = moe.inner if work.expert_parallel and work.tp > 1 else moe.inner // work.tp
        widest = rows * (3 * inner + 2 * shape.hidden) * c
    else:
        widest = 3 * w * max(shape.mlp_inner // work.tp, heads * max(shape.q_dim, shape.v_dim)) * c
    return 2 * work.sp_tokens * shape.hidden * work.precision.residual + widest


def model_activations(hidden: int, work: Work, *, first: bool, last: bool, rotary: int) -> dict[str, int]:
    """What the model keeps outside its layers for one microbatch: the token ids (first stage), RoPE's cos/sin, the
    final norm (last stage)."""
    out = {"token ids": work.tokens * 8 if first else 0,
           "rope cos/sin": 2 * work.seq // work.cp * rotary * max(work.precision.residual, 4)}
    if last:
        out["final norm"] = norm(hidden, work.sp_tokens, work.precision.residual, False, trained=not work.frozen_norms)
    return out


def tower_norm(tower: TowerShape, kind: str, tokens: int, r: int) -> int:
    """A norm of the vision tower over `tokens`: LayerNorm keeps its input (fp32 under autocast) and an fp32 mean and
    rstd; transformers' RMSNorm its input in fp32, the rsqrt and the normalised input in the input's dtype."""
    if kind == "layer":
        return tokens * (tower.hidden * max(r, 4) + 8)
    return norm(tower.hidden, tokens, r, False)


def tower_layer(tower: TowerShape, tokens: int, tp: int, p: Precision) -> dict[str, int]:
    """{what: bytes} one encoder layer of the vision tower keeps for backward, for `tokens` of images on one rank,
    its heads and MLP split over `tp` (1: whole): the norms and the projections' inputs; q, k and v as projected (with
    rotary positions also q and k rotated); SDPA's output and log-sum-exp; a fused-qkv tower's copy of the output (it
    attends image by image); the MLP's inner-wide tensors (`act_tensors`)."""
    c, r, t = p.compute, p.residual, tokens
    width, heads = tower.heads // tp * tower.head_dim, max(1, tower.heads // tp)
    out = {"attention norm": tower_norm(tower, tower.norm, t, r),
           "q/k/v input": linear_input(tower.hidden, t, r, p, 1 if tower.fused_qkv else 3),
           "q/k/v": 3 * t * width * c}
    if tower.rotary:
        out["rotary q/k"] = 2 * t * width * c
    out["attention"] = t * width * c + t * heads * 4
    if tower.fused_qkv:
        out["output projection input"] = t * width * c
    gated = tower.act_tensors == 4
    out["mlp norm"] = tower_norm(tower, tower.norm, t, r)
    out["mlp input"] = linear_input(tower.hidden, t, r, p, 2 if gated else 1)
    out["mlp"] = tower.act_tensors * t * (tower.inner // tp) * c
    return out


def tower_activations(tower: TowerShape, tokens: int, tp: int, p: Precision, *, checkpointed: bool = False
                      ) -> dict[str, int]:
    """{what: bytes} the vision tower keeps for backward for `tokens` of images (patches, class tokens) on one rank:
    its layers (under activation checkpointing each layer's input only), the rotary cos / sin they share (fp32), the
    norms and linears outside them (the patch norms; the projector: each linear's input, the activation between two,
    rows merged where a linear reads several patches' features)."""
    layer = sum(tower_layer(tower, tokens, tp, p).values())
    kept = tokens * tower.hidden * p.residual if checkpointed else layer
    out = {"tower layers": tower.depth * kept, "tower norms and projector": 0}
    if tower.rotary:
        out["tower rotary cos/sin"] = 2 * tokens * tower.head_dim * 4
    norms = [entry[2] for entry in tower.outside if entry[0] == "norm"]
    linears = [entry for entry in tower.outside if entry[0] == "linear"]
    out["tower norms and projector"] += sum(tower_norm(tower, kind, tokens, p.residual) for kind in norms)
    for i, (_, n_in, n_out) in enumerate(linears):
        rows = tokens * tower.hidden // n_in if n_in % tower.hidden == 0 else tokens
        followed = i + 1 < len(linears) and linears[i + 1][1] == n_out  # an activation between the two keeps
        out["tower norms and projector"] += rows * (n_in + n_out * followed) * p.compute
    return out


@dataclass(frozen=True)
class LossMemory:
    """The loss's memory for one microbatch. held: saved from its forward to its backward; output: the logits, which
    the caller holds (a pipeline's last stage each microbatch's until its backward); forward / backward: its
    transient peak in each; head_grad: the head's gradient (the fused loss makes it in forward); chunk: tokens per
    chunk of the fused loss (0: whole logits)."""

    held: int
    output: int = 0
    forward: int = 0
    backward: int = 0
    head_grad: int = 0
    chunk: int = 0


def fused_loss(hidden: int, local_vocab: int, work: Work) -> LossMemory:
    """The head fused with the loss (losses._FusedLinearCrossEntropy): its gradients, made in forward, held until
    backward (d hidden (tokens, hidden), d head (local vocab, hidden) in the matmuls' dtype), and one chunk's logits
    at a time (`chunk_tokens`: about 64M floats): the matmul's output, its fp32 copy and its gradient."""
    p, w = work.precision, work.tokens
    m = p.compute  # the matmuls' dtype: autocast's, FSDP2's gathered head's, or the parameters'
    chunk = min(w, chunk_tokens(local_vocab))
    logits = chunk * local_vocab * (m + (4 + m if m != 4 else 0))  # raw, fp32 copy, gradient in the matmul dtype
    cast = local_vocab * hidden * p.param if m != p.param and not p.autocast else 0  # d head in the weight's dtype
    copy = local_vocab * hidden * m if p.autocast else 0  # autocast: the head cast once for all chunks
    return LossMemory(w * hidden * p.residual, forward=max(logits + chunk * hidden * m, cast) + copy,
                      head_grad=local_vocab * hidden * m, chunk=chunk)


def logits_loss(hidden: int, local_vocab: int, work: Work) -> LossMemory:
    """The loss from whole logits (a pipeline's last stage; `loss="logits"`): the head's input and the fp32
    (log-)softmax the cross-entropy keeps; the logits themselves (the output); in forward their fp32 copy (half
    precision); in backward the gradient of the log-softmax and the one it makes (fp32 each, beside the kept
    log-softmax); the head's gradient, made in backward."""
    p, w = work.precision, work.tokens
    c, scores = p.compute, w * local_vocab
    return LossMemory(scores * 4 + linear_input(hidden, w, p.residual, p), output=scores * c,
                      forward=scores * 4 if c != 4 else 0, backward=scores * 8,
                      head_grad=local_vocab * hidden * p.param)
