"""A training layout and the settings of the run it is planned for: the planner's inputs, pure data.

    Layout.parse("tp=2,cp=2", world=8)   # Layout(tp=2, cp=2, dp_shard=2): dp_shard takes the rest
    TrainSettings(batch_size=4, seq_len=8192, bf16=True, gradient_checkpointing=True)
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

AXES = ("tp", "cp", "pp", "dp_shard", "dp_replicate", "ep")  # the order `Layout.spell` writes them in (`--layout`)


@dataclass(frozen=True)
class Layout:
    """Sizes of the axes (topology.ParallelDims'): ep is taken from dp_shard's ranks, so the world is
    pp x dp_replicate x dp_shard x cp x tp."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each trains on its own `batch_size` sequences."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shards(self) -> int:
        """The ranks FSDP2 shards a dense parameter over (dp_shard x cp, torchtitan's dp_shard_cp)."""
        return self.dp_shard * self.cp

    @property
    def data_parallel(self) -> bool:
        """Whether the Trainer wraps the model in FSDP2 (`apply_data_parallel`: dp_replicate x dp_shard x cp > 1)."""
        return self.dp_replicate * self.fsdp_shards > 1

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    def spell(self) -> str:
        """"tp=2,cp=2,dp_shard=2": the sizes above 1 (dp_shard always), as `--layout` reads them."""
        return ",".join(f"{axis}={size}" for axis, size in self.sizes().items() if size > 1 or axis == "dp_shard")

    @classmethod
    def parse(cls, text: str, world: int) -> "Layout":
        """`--layout tp=2,cp=2,pp=2,dp_shard=2,dp_replicate=1,ep=2`: omitted sizes are 1, except dp_shard, which
        takes the rest of `world` when omitted. ValueError naming the bad part, or what the world does not divide."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            axis, _, value = part.partition("=")
            axis = axis.strip()
            if axis not in AXES or not value.strip().isdigit() or int(value) < 1:
                raise ValueError(f"--layout {text!r}: {part!r} is not AXIS=SIZE with AXIS one of {', '.join(AXES)} "
                                 f"and SIZE a positive integer (e.g. tp=2,cp=2,pp=2)")
            if axis in sizes:
                raise ValueError(f"--layout {text!r} gives {axis} twice")
            sizes[axis] = int(value)
        if "dp_shard" not in sizes:
            rest = math.prod(size for axis, size in sizes.items() if axis != "ep")
            if world % rest:
                raise ValueError(f"--layout {text!r} needs a multiple of {rest} ranks ({' x '.join(f'{a} {s}' for a, s in sizes.items() if a != 'ep')}), "
                                 f"but --world is {world}; use a world of {rest} x N, or other sizes")
            sizes["dp_shard"] = world // rest
        layout = cls(**sizes)
        if layout.world != world:
            raise ValueError(f"--layout {text!r} is {layout.world} ranks ({layout.spell()}), but --world is {world}; "
                             f"make the sizes' product {world}, or leave dp_shard out (it takes the rest)")
        return layout


@dataclass(frozen=True)
class TrainSettings:
    """What `tptrain train` would run. batch_size: sequences per data-parallel rank per step (--batch-size);
    seq_len: tokens per sequence; dtype: the parameters' dtype (--dtype); bf16: --bf16 (FSDP2 mixed precision, or
    autocast without data parallelism); gradient_checkpointing: each decoder layer recomputed in backward; lora_r:
    LoRA adapters of this rank on every linear layer below the head (0: full fine-tuning); optim_in_backward: each
    gradient stepped and freed in backward; pp_schedule / pp_microbatches: the pipeline's (microbatches default to
    pp); sequence_parallel / expert_parallel: DistributedConfig's flags; loss: "fused" (tptrain's head fused with the
    loss, chunk by chunk) or "logits" (whole logits, then the cross-entropy: what a pipeline's last stage does, and
    other frameworks)."""

    batch_size: int
    seq_len: int
    dtype: torch.dtype = torch.float32
    bf16: bool = False
    gradient_checkpointing: bool = False
    lora_r: int = 0
    optim_in_backward: bool = False
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None
    sequence_parallel: bool = False
    expert_parallel: bool = False
    loss: str = "fused"

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.lora_r < 0:
            raise ValueError(f"--lora-r must be >= 0, got {self.lora_r}")
        if self.loss not in ("fused", "logits"):
            raise ValueError(f"loss must be 'fused' or 'logits', got {self.loss!r}")

    def microbatches(self, pp: int) -> int:
        return self.pp_microbatches or pp if pp > 1 else 1

    def as_dict(self) -> dict:
        out = asdict(self)
        out["dtype"] = str(self.dtype).removeprefix("torch.")
        return out
