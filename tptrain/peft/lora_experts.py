"""LoRA on stacked mixture-of-experts projections, laid out like the experts and saved as peft writes it.

peft 0.21 on transformers 5 adapts the experts' fused parameters (`target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"]`, one `lora.ParamWrapper` per parameter): expert e's weight W_e (out, in) becomes
W_e + s * B_e @ A_e. For `gate_up_proj` (gate rows then up rows) one A_e serves both, so gate and up share it.
In memory tptrain keeps per-expert stacked factors beside its stacked gate/up/down:

  lora_gate_up_A (E, r, hidden)   lora_gate_B, lora_up_B (E, inner, r)   (gate_up_proj's A and its B, split in two)
  lora_down_A (E, r, inner)       lora_down_B (E, hidden, r)

and adds s * (x @ A_e^T) @ B_e^T to each expert's projection inside the grouped matmul (`Experts.project`), so
every expert style's collectives carry the adapter too. Each factor follows the base weight's split:

  experts split (dim 0, expert parallel)   A and B split by expert: every gradient is whole on its owner.
  over an ep axis (ep_size)                A and B split by expert over ep too, then as below inside each expert.
  out split (dim 1, gate/up under ETP)     A replicated (a per-rank partial gradient), B split on its out dim.
  in split (dim 2, down under ETP)         A split on its in dim, B replicated (a per-rank partial gradient).

On disk (`to_disk` / `from_disk`, the only conversion): peft's A is (r*E, in) with expert e's rows at [e*r, (e+1)*r),
its B (out, r*E) with expert e's column j at j*E + e; the two ParamWrappers nest, the last parameter transformers
registers (`down_proj`) outermost, so the inner one's keys carry one `base_layer.` per targeted parameter after it.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tptrain.parallel.contract import routed_experts
from tptrain.parallel.styles import ShardSpec, TPContext
from tptrain.peft.lora import ADAPTER, PARTIAL, REPLICATED, LoraRuntime, add_to_block, mix_seed, over_dp

# transformers 5's fused expert parameters, in the order its experts modules register them (peft's nesting order).
FUSED = ("gate_up_proj", "down_proj")
STACKED = ("gate_proj", "up_proj", "down_proj")  # tptrain's stacked parameters of an experts module


def is_experts(module: nn.Module) -> bool:
    """An experts module as tptrain holds them: stacked 3-D gate/up/down and a grouped matmul with `project`."""
    return hasattr(module, "project") and all(
        isinstance(getattr(module, n, None), nn.Parameter) and getattr(module, n).dim() == 3 for n in STACKED)


def factor_specs(base: ShardSpec, where: str) -> tuple[ShardSpec, ShardSpec]:
    """(spec of A (E, r, in), spec of B (E, out, r)) for a stacked weight (E, out, in) laid out as `base`; over an ep
    axis both split by expert as the weight is (this rank's experts' factors only: their gradients whole on it), and
    inside each expert as below."""
    if base.replicas != 1 or base.segments:
        raise ValueError(f"LoRA cannot adapt {where!r}: its layout {base} is not a plain split")
    if base.ep_split:
        return tuple(dataclasses.replace(spec, ep_split=True)
                     for spec in factor_specs(dataclasses.replace(base, ep_split=False), where))
    if base.dim is None:
        return REPLICATED, REPLICATED
    if base.dim == 0:
        return ShardSpec(0), ShardSpec(0)
    return (PARTIAL, ShardSpec(1)) if base.dim == 1 else (ShardSpec(2), PARTIAL)


class LoraExperts(nn.Module):
    """Wraps an experts module (`base_layer`) with LoRA on `ranks`' keys (a subset of FUSED, in FUSED order), each
    with its (r, scaling)."""

    def __init__(self, base: nn.Module, *, name: str, ranks: dict[str, tuple[int, float]],
                 shapes: tuple[int, int, int], specs: dict[str, ShardSpec], ctx: TPContext | None,
                 runtime: LoraRuntime, dtype: torch.dtype) -> None:
        self._setup(base, name=name, ranks=ranks, ctx=ctx, runtime=runtime, experts=shapes[0])
        experts, inner, hidden = shapes  # global (unsharded) sizes
        device = base.gate_proj.device
        # {fused target: (A name, B names)}: B of gate_up_proj held as two (gate rows, up rows) beside gate / up
        self.factor_names = {"gate_up_proj": ("lora_gate_up_A", ("lora_gate_B", "lora_up_B")),
                             "down_proj": ("lora_down_A", ("lora_down_B",))}
        if "gate_up_proj" in ranks:
            r, scaling = ranks["gate_up_proj"]
            spec_a, spec_b = factor_specs(specs["gate_proj"], f"{name}.gate_up_proj")
            self._factor("lora_gate_up_A", spec_a, (experts, r, hidden), "gate_up_proj", dtype, device)
            self._factor("lora_gate_B", spec_b, (experts, inner, r), None, dtype, device)
            self._factor("lora_up_B", spec_b, (experts, inner, r), None, dtype, device)
            self.pairs["gate_proj"] = ("lora_gate_up_A", "lora_gate_B", scaling)
            self.pairs["up_proj"] = ("lora_gate_up_A", "lora_up_B", scaling)
        if "down_proj" in ranks:
            r, scaling = ranks["down_proj"]
            spec_a, spec_b = factor_specs(specs["down_proj"], f"{name}.down_proj")
            self._factor("lora_down_A", spec_a, (experts, r, inner), "down_proj", dtype, device)
            self._factor("lora_down_B", spec_b, (experts, hidden, r), None, dtype, device)
            self.pairs["down_proj"] = ("lora_down_A", "lora_down_B", scaling)
        base.project = self.project  # the grouped matmul's per-expert projection, now with the adapter term

    def _setup(self, base: nn.Module, *, name: str, ranks: dict[str, tuple[int, float]], ctx: TPContext | None,
               runtime: LoraRuntime, experts: int) -> None:
        nn.Module.__init__(self)
        self.base_layer = base
        self.name, self.ranks = name, dict(ranks)
        self.targets = tuple(t for t in FUSED if t in ranks)
        self.ctx, self.runtime = ctx, runtime
        self.num_experts = experts  # global
        self._layout: dict[str, tuple[ShardSpec, tuple[int, ...]]] = {}
        # {stacked weight: (A name, B name, scaling)}: which factors join which projection
        self.pairs: dict[str, tuple[str, str, float]] = {}

    def _factor(self, attr: str, spec: ShardSpec, shape: tuple[int, ...], init_key: str | None,
                dtype: torch.dtype, device: torch.device) -> None:
        """A factor from its FULL shape (A: peft's kaiming-uniform bound 1/sqrt(in) under a seed every rank shares;
        B: zeros), then sliced."""
        if init_key is None:
            full = torch.zeros(shape)
        else:
            gen = torch.Generator().manual_seed(mix_seed(self.runtime.seed, f"{self.name}.{init_key}", "init"))
            bound = shape[-1] ** -0.5
            full = torch.empty(shape).uniform_(-bound, bound, generator=gen)
        setattr(self, attr, nn.ParameterDict({ADAPTER: nn.Parameter(self._local(full, spec).clone().to(device, dtype))}))
        self._layout[f"{attr}.{ADAPTER}"] = (spec, shape)

    def forward(self, *args, **kwargs):
        return self.base_layer(*args, **kwargs)

    def factor(self, attr: str) -> torch.Tensor:
        return getattr(self, attr)[ADAPTER]

    def layout(self) -> dict[str, tuple[ShardSpec, tuple[int, ...]]]:
        """{factor name: (ShardSpec, unsharded shape)}."""
        return dict(self._layout)

    def project(self, name: str, i: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = type(self.base_layer).project(self.base_layer, name, i, x, weight)
        if name not in self.pairs or not self.runtime.enabled:
            return out
        a_name, b_name, scaling = self.pairs[name]
        a, b = self.factor(a_name)[i], self.factor(b_name)[i]  # (r, in), (out, r): held expert i, this rank's slice
        # As LoraLinear: A in the input's dtype, the (n, r) result on in the adapter's dtype.
        after_a = x @ a.to(x.dtype).T
        return out + ((after_a.to(b.dtype) @ b.T) * scaling).to(out.dtype)

    # ------------------------------------------------------------------ peft's tensors

    def disk_prefix(self, target: str) -> str:
        """Key prefix of `target`'s factors under the module name: one `base_layer.` per ParamWrapper around it."""
        return "base_layer." * (len(self.targets) - 1 - self.targets.index(target))

    def disk_shapes(self) -> dict[str, tuple[int, int]]:
        """{key under the module name: shape} of peft's file."""
        out = {}
        for target in self.targets:
            a, b = self._full_pair(target)
            rows = self.num_experts * self.ranks[target][0]
            p = self.disk_prefix(target)
            out[f"{p}lora_A.weight"], out[f"{p}lora_B.weight"] = (rows, a[2]), (b[1], rows)
        return out

    def _full_pair(self, target: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Unsharded (A, B) shapes of `target`, B of gate_up_proj being the gate rows then the up rows."""
        a_name, b_names = self.factor_names[target]
        e, _, r = self._layout[f"{b_names[0]}.{ADAPTER}"][1]
        rows = sum(self._layout[f"{b}.{ADAPTER}"][1][1] for b in b_names)
        return self._layout[f"{a_name}.{ADAPTER}"][1], (e, rows, r)

    def to_disk(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """peft's tensors {key under the module name: tensor} from this layer's full factors {factor name: tensor}."""
        out = {}
        for target in self.targets:
            a_name, b_names = self.factor_names[target]
            a = full[f"{a_name}.{ADAPTER}"]
            b = torch.cat([full[f"{b}.{ADAPTER}"] for b in b_names], dim=1)
            p = self.disk_prefix(target)
            out[f"{p}lora_A.weight"] = a.flatten(0, 1)  # (E*r, in): expert-major rows
            out[f"{p}lora_B.weight"] = b.permute(1, 2, 0).flatten(1)  # (out, r*E): column j*E + e
        return out

    def from_disk(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This layer's full factors {factor name: tensor} from peft's tensors {key under the module name: tensor}."""
        out = {}
        for target in self.targets:
            e, r, p = self.num_experts, self.ranks[target][0], self.disk_prefix(target)
            a_disk, b_disk = tensors[f"{p}lora_A.weight"], tensors[f"{p}lora_B.weight"]
            a_name, b_names = self.factor_names[target]
            out[f"{a_name}.{ADAPTER}"] = a_disk.reshape(e, r, a_disk.shape[1])
            b = b_disk.reshape(b_disk.shape[0], r, e).permute(2, 0, 1)  # (E, out, r)
            rows = [self._layout[f"{n}.{ADAPTER}"][1][1] for n in b_names]
            out.update({f"{n}.{ADAPTER}": part for n, part in zip(b_names, b.split(rows, dim=1))})
        return out

    def load_full(self, full: dict[str, torch.Tensor]) -> None:
        """Copy this rank's slice of every full factor {factor name: tensor} into the factors."""
        with torch.no_grad():
            for local_name, t in full.items():
                spec, p = self._layout[local_name][0], self.get_parameter(local_name)
                p.copy_(self._local(t, spec).to(p.dtype))

    def _local(self, full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        """This rank's piece of a full factor: its experts over an ep axis, then its TP chunk."""
        if self.ctx is None:
            return full
        full = spec.ep_chunk(full, self.ctx.ep_size, self.ctx.ep_rank)
        return full if spec.dim is None else spec.local_chunk(full, self.ctx.size, self.ctx.rank)

    # ------------------------------------------------------------------ merging

    def delta(self, weight_name: str, weight: torch.Tensor, *, factor=None) -> torch.Tensor:
        """s * B_e @ A_e for every held expert: this rank's block of the adapted stacked weight (experts, out, in);
        `factor` reads a factor (default: the parameter as it is)."""
        a, b, scaling = self.pairs[weight_name]
        factor = factor or self.factor
        compute = torch.promote_types(weight.dtype, torch.float32)
        return (torch.bmm(factor(b).to(compute), factor(a).to(compute)) * scaling).to(weight.dtype)

    @torch.no_grad()
    def merge(self) -> nn.Module:
        """Fold s * B_e @ A_e into this rank's block of every adapted stacked weight; return the base, unhooked. Under
        FSDP2 collective over the dp axes (`over_dp`)."""
        base = self.base_layer
        for weight_name in self.pairs:
            weight = getattr(base, weight_name)
            add_to_block(weight, self.delta(weight_name, weight, factor=lambda name: over_dp(self.factor(name))))
        return self.unhook()

    def unhook(self) -> nn.Module:
        del self.base_layer.project  # back to the class's plain projection
        return self.base_layer


def is_fused_experts(module: nn.Module) -> bool:
    """An experts module holding transformers' fused stacks as they are adapted: `gate_up_proj` (E, 2 inner, hidden)
    and `down_proj` (E, hidden, inner), (out, in) per expert, called as forward(x, expert_ids, weights)
    (`contract.routed_experts`: transformers' experts on the transformers backend)."""
    return (routed_experts(module) and not getattr(module, "is_transposed", False)
            and all(isinstance(getattr(module, n, None), nn.Parameter) and getattr(module, n).dim() == 3
                    for n in FUSED))


def fused_factor_specs(base: ShardSpec, where: str) -> tuple[ShardSpec, ShardSpec]:
    """(spec of A (E, r, in), spec of B (E, out, r)) for a fused stacked weight (E, out, in) laid out as `base`: as
    `factor_specs`, B split with the weight's rows (each packed half alone) and A with its columns; over an ep axis
    both split by expert as well (each rank's experts' factors only: their gradients whole on it)."""
    if base.ep_split:  # over an ep axis the factors hold this rank's experts too, split inside as below
        return tuple(dataclasses.replace(spec, ep_split=True)
                     for spec in fused_factor_specs(dataclasses.replace(base, ep_split=False), where))
    if base.dim in (1, 2) and base.replicas == 1:
        return (PARTIAL, base) if base.dim == 1 else (base, PARTIAL)
    return factor_specs(base, where)


class LoraFusedExperts(LoraExperts):
    """LoRA on transformers' experts (`is_fused_experts`): the factors of each fused parameter as peft holds them,
    A (E, r, in) and B (E, out, r) (gate_up_proj's B whole: its gate rows then its up rows), and forward runs the
    module on W + s * B_e @ A_e (transformers' own experts kernel, so every expert style's collectives carry the
    adapter), as peft's ParamWrapper does by parametrization. Each factor follows its weight's split
    (`fused_factor_specs`)."""

    def __init__(self, base: nn.Module, *, name: str, ranks: dict[str, tuple[int, float]],
                 shapes: dict[str, tuple[int, int, int]], specs: dict[str, ShardSpec], ctx: TPContext | None,
                 runtime: LoraRuntime, dtype: torch.dtype) -> None:
        self._setup(base, name=name, ranks=ranks, ctx=ctx, runtime=runtime, experts=shapes["down_proj"][0])
        self.factor_names = {}
        device = base.down_proj.device
        for target in self.targets:
            (experts, out, inner), (r, scaling) = shapes[target], ranks[target]
            spec_a, spec_b = fused_factor_specs(specs[target], f"{name}.{target}")
            a_name, b_name = f"lora_{target[:-5]}_A", f"lora_{target[:-5]}_B"  # lora_gate_up_A, lora_down_B, ...
            self._factor(a_name, spec_a, (experts, r, inner), target, dtype, device)
            self._factor(b_name, spec_b, (experts, out, r), None, dtype, device)
            self.factor_names[target], self.pairs[target] = (a_name, (b_name,)), (a_name, b_name, scaling)

    def forward(self, *args, **kwargs):
        if not self.runtime.enabled:
            return self.base_layer(*args, **kwargs)
        adapted = {t: getattr(self.base_layer, t) for t in self.pairs}
        adapted = {t: w + self.delta(t, w) for t, w in adapted.items()}
        return torch.func.functional_call(self.base_layer, adapted, args, kwargs, tie_weights=False, strict=False)

    def unhook(self) -> nn.Module:
        return self.base_layer
