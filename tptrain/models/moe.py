"""The mixture-of-experts block: a softmax top-k router (or DeepSeek-V3's group-limited sigmoid router) over stacked
SwiGLU experts (and an optional shared expert), and the load-balancing aux loss, as transformers computes them
(Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3).

Single-device code. Experts are held stacked, `experts.gate_proj` / `up_proj` (experts, inner, hidden) and
`experts.down_proj` (experts, hidden, inner); the hub's per-expert tensors (`mlp.experts.{i}.gate_proj.weight`,
Mixtral's `block_sparse_moe.experts.{i}.w1.weight`) are converted at the checkpoint boundary only
(`checkpoint_keys`). Under tensor or expert parallelism the same code runs on this rank's share: the inner width
is read from the tensors, and `experts.expert_offset` (set by the expert-parallel style) is the global index of
the first expert held here.
"""
from __future__ import annotations

import itertools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    """`num_experts` SwiGLU experts as stacked weights, applied to the tokens routed to each."""

    def __init__(self, num_experts: int, hidden: int, inner: int, *, top_k: int) -> None:
        super().__init__()
        self.num_experts = num_experts  # global count; this module may hold a contiguous share of them
        self.top_k = top_k  # experts per token (the router's k): what the expert-parallel style sizes its choice by
        self.expert_offset = 0  # global index of gate_proj[0]
        self.gate_proj = nn.Parameter(torch.empty(num_experts, inner, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (..., hidden): the tokens, e.g. (batch, seq, hidden); expert_ids, weights (tokens, k): each token's
        global experts and their weights. Returns x's shape: the weighted sum over the experts held here (zero rows
        for other tokens)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (tokens, hidden)
        counts, order = sort_by_expert(expert_ids, self.num_experts)
        held = slice(self.expert_offset, self.expert_offset + self.gate_proj.shape[0])
        first, last = sum(counts[:held.start]), sum(counts[:held.stop])
        mine = order[first:last]  # this module's assignments (flat token * k + slot), grouped by expert
        tokens = mine // expert_ids.shape[1]
        ys = self.grouped(x[tokens], counts[held])  # (assignments, hidden)
        w = weights.flatten()[mine, None]
        out = x.new_zeros(shape)  # a tensor of its own (not a view: FSDP2 wraps the experts as a module)
        out.view(-1, shape[-1]).index_add_(0, tokens, (ys * w).to(x.dtype))
        return out

    def grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The grouped matmul: `rows` (n, hidden) sorted by held expert, `counts[i]` for expert i held here; returns
        (n, hidden). torch's grouped GEMM where it runs (`grouped_mm_dtype`); else (fp64, or an adapter that replaced
        `project` on this instance: LoRA's per-expert term, which only the loop calls) one matmul per expert
        (`loop`, the reference). Either way each held weight has a gradient, zero for an expert given no row."""
        dtype = None if "project" in vars(self) else grouped_mm_dtype(rows, self.gate_proj, self.up_proj,
                                                                       self.down_proj)
        if dtype is None:
            return self.loop(rows, counts)
        ends = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=rows.device)  # (held,)
        # (held, in, out): the stacked (held, out, in) weights as column-major matrices, as the kernel takes them
        gate, up, down = (w.to(dtype).transpose(1, 2) for w in (self.gate_proj, self.up_proj, self.down_proj))
        x = rows.to(dtype)
        h = F.silu(F.grouped_mm(x, gate, offs=ends)) * F.grouped_mm(x, up, offs=ends)  # (n, inner)
        return F.grouped_mm(h, down, offs=ends)

    def loop(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`grouped` as one matmul per held expert (each through `project`); every held expert runs, with no row
        too, so each weight has a gradient (zero when it got no token)."""
        outs = []
        # unbind, not gate_proj[i]: its backward stacks the experts' gradients once, where indexing would fill a
        # zero tensor of the whole stack for every expert (a quarter of this function's time on CPU).
        experts = zip(self.gate_proj.unbind(0), self.up_proj.unbind(0), self.down_proj.unbind(0))
        for i, ((gate, up, down), chunk) in enumerate(zip(experts, rows.split(counts))):
            h = F.silu(self.project("gate_proj", i, chunk, gate)) * self.project("up_proj", i, chunk, up)  # (n_i, I)
            outs.append(self.project("down_proj", i, h, down))
        return torch.cat(outs)

    def project(self, name: str, i: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ W_i^T for held expert i of stacked weight `name` (`weight` = its slice W_i). Adapters (LoRA on the
        experts) replace it on the instance to add their per-expert term."""
        return x @ weight.T


def grouped_mm_dtype(rows: torch.Tensor, *weights: torch.Tensor) -> torch.dtype | None:
    """The dtype torch's grouped GEMM (`F.grouped_mm`) computes `rows` (n, in) times each stacked weight
    (experts, out, in) in here (autocast's, as the loop's matmuls would), or None where it does not run
    (`grouped_mm_runs`), for an fp64 operand, for operands of different dtypes outside autocast (the loop raises the
    usual error), and for rows not a multiple of 16 bytes apart or not 16-byte aligned (the kernel's layout)."""
    device = rows.device
    autocast = torch.is_autocast_enabled(device.type)
    dtype = torch.get_autocast_dtype(device.type) if autocast else rows.dtype
    operands = (rows, *weights)
    if not grouped_mm_runs(device, dtype) or any(
            t.dtype == torch.float64 or not autocast and t.dtype != dtype for t in operands):
        return None
    # A cast operand is a new tensor with the same strides (the allocator aligns it); one used as is must be aligned.
    if not all(t.stride(-1) == 1 and t.stride(-2) * dtype.itemsize % 16 == 0
               and (t.dtype != dtype or t.data_ptr() % 16 == 0) for t in operands):
        return None
    return dtype


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `F.grouped_mm` (torch >= 2.10) computes in `dtype` on `device`: fp32 and bf16 on the CPU and on CUDA
    sm80+ (fp16 is left to the loop); inside a compiled graph bf16 only (inductor lowers no other)."""
    if not hasattr(F, "grouped_mm") or dtype not in (torch.float32, torch.bfloat16):
        return False
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu"


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[list[int], torch.Tensor]:
    """(assignments per global expert, as a list; the flat (tokens * k) assignment indices sorted by expert)."""
    flat = expert_ids.flatten()
    return torch.bincount(flat, minlength=num_experts).tolist(), torch.sort(flat, stable=True).indices


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter): sigmoid scores; a token picks its top-k experts
    by score + `e_score_correction_bias` among the `topk_group` best of `n_group` groups (a group's worth: the sum
    of its two best), weighted by the score alone, renormalised (`norm_topk_prob`) and scaled by
    `routed_scaling_factor`. In fp32 for bf16/fp32 models, as transformers (fp64 stays fp64: exact tests).
    The bias is the aux-loss-free balancing term, set outside backprop: a frozen parameter (loaded, saved and
    checkpointed, never trained), kept in at least fp32 in a bf16 model (`keep_in_float32`, read by the loader;
    transformers' `_keep_in_fp32_modules_strict`): scores of neighbouring experts differ by less than bf16 resolves."""

    keep_in_float32 = ("e_score_correction_bias",)

    def __init__(self, config) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        wide = torch.promote_types(torch.get_default_dtype(), torch.float32)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=wide), requires_grad=False)
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, hidden) -> (logits (tokens, experts), weights, expert ids (tokens, k)), at least fp32."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(dtype), self.weight.to(dtype))
        scores = logits.sigmoid()
        choice = scores.detach() + self.e_score_correction_bias.to(dtype)  # picks; the weights come from `scores`
        groups = choice.view(choice.shape[0], self.n_group, -1)  # (tokens, n_group, experts per group)
        best = groups.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1, sorted=False).indices
        kept = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)  # (tokens, n_group)
        choice = groups.masked_fill(~kept[..., None], float("-inf")).flatten(1)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, weights * self.scaling, ids


class SparseMoeBlock(nn.Module):
    """Router (`gate`) + experts (+ a sigmoid-gated `shared_expert`, or ungated `shared_experts`). Keeps its router
    logits of the last forward in `router_logits` for the aux loss."""

    def __init__(self, config, dense_mlp: type[nn.Module]) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weights_in_float32 = config.router_weights_in_float32
        self.group_limited = config.router_scoring == "sigmoid"
        self.gate = GroupLimitedRouter(config) if self.group_limited else nn.Linear(hidden, config.num_experts,
                                                                                      bias=False)
        self.experts = Experts(config.num_experts, hidden, config.moe_intermediate_size, top_k=self.top_k)
        if config.shared_expert_intermediate_size:
            self.shared_expert = dense_mlp(config, inner=config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        if config.shared_experts_intermediate_size:
            self.shared_experts = dense_mlp(config, inner=config.shared_experts_intermediate_size)
        self.router_logits: torch.Tensor | None = None  # (tokens, num_experts) of the last forward

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits (tokens, experts), top-k weights, top-k expert ids (tokens, k)). Softmax in fp32,
        top-k, optional renormalisation, weights cast back (or kept fp32: Mixtral): transformers' TopKRouter. Or
        the group-limited sigmoid router's."""
        if self.group_limited:
            return self.gate(x)
        logits = self.gate(x)
        probs = logits.softmax(-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        # Kept in (at least) fp32 for Mixtral, fp64 staying fp64 (exact tests); else cast to the activations' dtype.
        dtype = torch.promote_types(logits.dtype, torch.float32) if self.weights_in_float32 else logits.dtype
        return logits, weights.to(dtype), ids

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (batch, seq, hidden), routed token by token; the experts and the shared expert(s) read h itself (the
        block's input boundary under tensor parallelism: under SP they gather its sequence once)."""
        self.router_logits, weights, ids = self.route(h.reshape(-1, h.shape[-1]))  # (tokens, experts), (tokens, k)
        out = self.experts(h, ids, weights)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(h)
        return out

    def checkpoint_keys(self, prefix: str, config) -> dict[str, str | list[str]]:
        """{in-memory parameter name: checkpoint name, or the per-expert names of a stacked tensor} of this block
        at module name `prefix` (`model.layers.0.mlp`), in the hub's layout."""
        disk = prefix.rpartition(".")[0] + "." + config.expert_checkpoint_module
        keys: dict[str, str | list[str]] = {f"{prefix}.gate.weight": f"{disk}.gate.weight"}
        for name, hub_name in config.expert_checkpoint_names.items():
            keys[f"{prefix}.experts.{name}"] = [f"{disk}.experts.{i}.{hub_name}.weight"
                                                for i in range(self.experts.num_experts)]
        return keys


def router_statistics(router_logits: list[torch.Tensor], attention_mask: torch.Tensor | None = None, *,
                      num_experts: int, top_k: int) -> torch.Tensor:
    """The load-balancing loss's token statistics (transformers' load_balancing_loss_func, Switch Transformer eqs. 4-6:
    its loss is `balancing_loss` of them) of some MoE layers' logits (tokens, experts) and the tokens' mask
    (batch, seq) or None: (2 experts + 1,) = [top-k assignments of each expert (no gradient), router probability
    summed over the tokens for each expert, tokens counted], summed over the layers. Sums of the statistics of
    other layers (a pipeline's other stages) or other tokens (other cp or sp ranks) are those of all of them. In
    the logits' dtype, at least fp32."""
    dtype = torch.promote_types(router_logits[0].dtype, torch.float32) if router_logits else torch.float32
    device = router_logits[0].device if router_logits else None
    counts = torch.zeros(num_experts, dtype=dtype, device=device)
    prob_sum, rows = torch.zeros_like(counts), torch.zeros((), dtype=dtype, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(dtype)
    for logits in router_logits:
        probs = logits.softmax(-1).to(dtype)
        selected = torch.topk(probs, top_k, dim=-1).indices
        token_weight = torch.ones(probs.shape[0], dtype=dtype, device=probs.device) if mask is None else mask
        counts = counts + torch.zeros_like(counts).scatter_add_(0, selected.reshape(-1),
                                                                token_weight.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * token_weight[:, None]).sum(0)
        rows = rows + token_weight.sum()
    return torch.cat([counts, prob_sum, rows[None]])


def balancing_loss(stats: torch.Tensor, num_experts: int, *,
                   total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The load-balancing loss of `router_statistics`' `stats`: num_experts * sum_e counts_e / rows * probs_e / rows.
    `total`: a tensor summed over the ranks holding the batch's other tokens (context or sequence parallelism; None:
    these are all). The counts and rows are then the whole batch's, and the result is this rank's share (its own
    router probabilities): summed over those ranks, one process's loss, and the gradient of each share, which
    reaches only its own tokens' probabilities, is that of one process's loss (the counts have none)."""
    counts, probs, rows = stats[:num_experts].detach(), stats[num_experts:-1], stats[-1].detach()
    if total is not None:
        summed = total(torch.cat([counts, rows[None]]))
        counts, rows = summed[:-1], summed[-1]
    return (counts / rows * (probs / rows)).sum() * num_experts
