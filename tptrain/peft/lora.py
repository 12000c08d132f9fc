"""LoRA layers that shard like their base layer and ride its collectives.

A `LoraLinear` / `LoraEmbedding` wraps the base module under PEFT's names (`q_proj.base_layer.weight`,
`q_proj.lora_A.default.weight`, `embed_tokens.lora_embedding_A.default`). The base keeps its TP style; the
adapter term is added to the base's per-rank result through `register_local_output_hook`, i.e. before the
style's output collective, so LoRA adds no activation collective:

  colwise base (output dim split)      A (r, in) replicated, applied to the same entered input; B (out, r) split
                                       like the base weight. The input gradient's partial rides the boundary's
                                       backward all-reduce; A's gradient is a per-rank partial (grad sync).
  rowwise base (input dim split)       A split on its input dim, B replicated: base_partial + s * B A_local x_local
                                       is summed by the base's one all-reduce. B's gradient is partial.
  vocab-parallel embedding             A (r, vocab) split on the vocabulary with the base's masking, B (out, r)
                                       replicated; same all-reduce. B's gradient is partial.

Every factor is initialised from its FULL shape with a generator seeded identically on every rank, then
sliced: replicated factors are equal on all ranks and the whole adapter equals the single-device one.
Dropout masks are drawn the same way (full input shape, seeded by (seed, forward count, layer)), so they
agree across TP ranks, are recomputed identically under activation checkpointing, and a TP run with
dropout equals the single-device run.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from tptrain.parallel.styles import STYLES, ShardSpec, TPContext, register_local_output_hook, vocab_shard_embedding

REPLICATED = ShardSpec()
PARTIAL = ShardSpec(None, partial_grad=True)
ADAPTER = "default"  # peft's adapter name; it appears in memory, never on disk


def mix_seed(*parts: int | str) -> int:
    """A stable 63-bit seed from `parts` (Python's hash() differs between processes)."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


@dataclass
class LoraRuntime:
    """State shared by the adapter layers of one model: the seed agreed over the TP group and a forward count,
    advanced by a pre-hook on the model (not on layers, so checkpoint recomputation reuses the same masks); whether
    the adapters act (`PeftModel.disable_adapter()` runs the base model: a preference objective's reference)."""

    seed: int
    step: int = 0
    enabled: bool = True


def factor_specs(style: str | None, base_spec: ShardSpec, where: str) -> tuple[ShardSpec, ShardSpec]:
    """(spec of A, spec of B) for a base module with TP style `style` and weight spec `base_spec`, as the style
    says an adapter on it splits (`ParallelStyle.adapter_split`)."""
    if style is None:  # not sharded: plain replicated module
        return REPLICATED, REPLICATED
    split = STYLES[style].adapter_split
    if split == "output":
        # B follows the weight's rows, incl. KV-head replicas and their partial grads, and a fused weight's
        # segments (each split on its own, so B's local rows line up with the base's local q, k, v)
        return PARTIAL, base_spec
    if split == "input":
        return ShardSpec(1), PARTIAL
    supported = ", ".join(name for name, cls in STYLES.items() if cls.adapter_split is not None)
    raise ValueError(f"LoRA cannot adapt {where!r}: its tensor-parallel style {style!r} is not supported (supported: "
                     f"{supported}); drop it from target_modules")


def over_dp(t: torch.Tensor) -> torch.Tensor:
    """This rank's TP block of a parameter: FSDP2's dp shards of it (a DTensor over the dp axes) gathered, a plain
    tensor as it is. Collective over the dp axes for a DTensor: every dp rank merges the same layers in one order."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def add_to_block(weight: torch.Tensor, delta: torch.Tensor) -> None:
    """weight += delta, `delta` being this rank's whole TP block of it: of an FSDP2-sharded weight only its dp shard's
    rows are added (its own slice of `delta`, no communication)."""
    if isinstance(weight, DTensor):
        delta = distribute_tensor(delta, weight.device_mesh, weight.placements, src_data_rank=None).to_local()
        weight = weight.to_local()
    weight.add_(delta.to(weight.dtype))


class LoraLayer(nn.Module):
    """Common part: the wrapped base, scaling, shard layout, dropout and the hook into the base's forward."""

    factor_names: tuple[str, str]  # (A, B) parameter names under this layer, as peft spells them

    def __init__(self, base: nn.Module, *, name: str, r: int, scaling: float, dropout: float, full_in: int,
                 full_out: int, specs: tuple[ShardSpec, ShardSpec], ctx: TPContext | None,
                 runtime: LoraRuntime) -> None:
        super().__init__()
        self.base_layer = base
        self.name, self.r, self.scaling, self.dropout = name, r, scaling, dropout
        self.full_in, self.full_out = full_in, full_out  # unsharded A is (r, full_in), B (full_out, r)
        self.spec_a, self.spec_b = specs
        self.ctx, self.runtime = ctx, runtime
        self._handle = register_local_output_hook(base, self._add_delta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x)

    def _add_delta(self, module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out + self.delta(x).to(out.dtype) if self.runtime.enabled else out

    @property
    def segment_sizes(self) -> tuple[int, ...]:
        """A fused base's local segment sizes (the model splits this layer's output by them, as the base's)."""
        return self.base_layer.segment_sizes

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_parameter(self.factor_names[0]), self.get_parameter(self.factor_names[1])

    def layout(self) -> dict[str, tuple[ShardSpec, tuple[int, int]]]:
        """{factor name: (ShardSpec, unsharded shape)}."""
        a, b = self.factor_names
        return {a: (self.spec_a, (self.r, self.full_in)), b: (self.spec_b, (self.full_out, self.r))}

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _chunk(self, full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        if spec.dim is None or self.ctx is None:
            return full
        return spec.local_chunk(full, self.ctx.size, self.ctx.rank).clone()

    def _init_generator(self) -> torch.Generator:
        # On the CPU: the same init whatever the device.
        return torch.Generator().manual_seed(mix_seed(self.runtime.seed, self.name, "init"))

    @torch.no_grad()
    def merge(self) -> nn.Module:
        """Fold s * B @ A into this rank's base shard (B_local @ A_local is exactly the local block for every
        layout) and return the base module, unhooked. Under FSDP2 collective over the dp axes (`over_dp`)."""
        a, b = (over_dp(t) for t in self.factors())
        weight = self.base_layer.weight
        compute = torch.promote_types(weight.dtype, torch.float32)  # bf16 bases merge in fp32
        delta = (b.to(compute) @ a.to(compute)) * self.scaling  # (out, in), this rank's block
        add_to_block(weight, delta if isinstance(self.base_layer, nn.Linear) else delta.T)
        return self.unhook()

    def unhook(self) -> nn.Module:
        self._handle.remove()
        return self.base_layer


class LoraLinear(LoraLayer):
    """peft's lora.Linear: out = base(x) + s * B(A(dropout(x)))."""

    factor_names = ("lora_A.default.weight", "lora_B.default.weight")

    def __init__(self, base: nn.Linear, *, dtype: torch.dtype, **kw) -> None:
        super().__init__(base, **kw)
        bound = self.full_in ** -0.5  # peft: kaiming_uniform_(a=sqrt(5)) on A, zeros on B
        a = torch.empty(self.r, self.full_in).uniform_(-bound, bound, generator=self._init_generator())
        b = torch.zeros(self.full_out, self.r)
        device = base.weight.device
        self.lora_A = nn.ModuleDict({ADAPTER: _linear(self._chunk(a, self.spec_a), dtype, device)})
        self.lora_B = nn.ModuleDict({ADAPTER: _linear(self._chunk(b, self.spec_b), dtype, device)})

    def delta(self, x):
        a, b = self.factors()
        # A runs in the input's dtype (as autocast would), so autograd saves the base's own input, not a
        # cast copy; the small (..., r) result continues in the adapter's dtype (fp32 for half bases).
        after_a = F.linear(self._dropout(x), a.to(x.dtype))
        return F.linear(after_a.to(b.dtype), b) * self.scaling

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0.0:
            return x
        # The mask of the FULL input, sliced like the input: equal on ranks sharing it, equal to one device's.
        chunks = 1 if self.spec_a.dim is None or self.ctx is None else self.spec_a.num_chunks(self.ctx.size)
        shape = (*x.shape[:-1], x.shape[-1] * chunks)
        seed = mix_seed(self.runtime.seed, self.name, "dropout", self.runtime.step)
        gen = torch.Generator(x.device).manual_seed(seed)
        keep = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - self.dropout, generator=gen)
        keep = self._chunk(keep, ShardSpec(-1) if chunks > 1 else REPLICATED)
        return x * keep / (1.0 - self.dropout)


class LoraEmbedding(LoraLayer):
    """peft's lora.Embedding: out = base(ids) + s * embedding(ids, A.T) @ B.T; A is (r, vocab), B is (dim, r)."""

    factor_names = ("lora_embedding_A.default", "lora_embedding_B.default")

    def __init__(self, base: nn.Embedding, *, dtype: torch.dtype, **kw) -> None:
        super().__init__(base, **kw)
        a = torch.zeros(self.r, self.full_in)  # peft: zeros on A, normal on B
        b = torch.randn(self.full_out, self.r, generator=self._init_generator())
        device = base.weight.device
        self.lora_embedding_A = nn.ParameterDict({ADAPTER: nn.Parameter(self._chunk(a, self.spec_a).to(device, dtype))})
        self.lora_embedding_B = nn.ParameterDict({ADAPTER: nn.Parameter(self._chunk(b, self.spec_b).to(device, dtype))})

    def delta(self, ids):
        a, b = self.factors()
        pad = self.base_layer.padding_idx
        if self.spec_a.dim is None:
            after_a = F.embedding(ids, a.T, padding_idx=pad)
        else:
            after_a = vocab_shard_embedding(ids, a.T, rank=self.ctx.rank, padding_idx=pad)
        return (after_a @ b.T) * self.scaling


def _linear(weight: torch.Tensor, dtype: torch.dtype, device: torch.device) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight.to(device, dtype))
    return layer
