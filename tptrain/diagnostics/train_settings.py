"""The settings of the run a layout is planned for: the planner's inputs beside the layout (tptrain.layout's
ParallelDims, `parse_layout("tp=2,cp=2", world=8)`), pure data.

    TrainSettings(batch_size=4, seq_len=8192, bf16=True, gradient_checkpointing=True)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from tptrain.checks import check_positive_int
from tptrain.dtypes import dtype_name

REFERENCES = ("copy", "adapters", "precomputed")  # a preference run's reference model


@dataclass(frozen=True)
class TrainSettings:
    """What `tptrain train` would run. batch_size: sequences per data-parallel rank per step (--batch-size);
    seq_len: tokens per sequence; dtype: the parameters' dtype (--dtype); bf16: --bf16 (FSDP2 mixed precision, or
    autocast without data parallelism); gradient_checkpointing: each decoder layer recomputed in backward; lora_r:
    LoRA adapters of this rank on every linear layer below the head (0: full fine-tuning); optim_in_backward: each
    gradient stepped and freed in backward; pp_schedule / pp_microbatches: the pipeline's (microbatches default to
    pp); sequence_parallel / expert_parallel: DistributedConfig's flags; loss: "fused" (tptrain's head fused with the
    loss, chunk by chunk) or "logits" (whole logits, then the cross-entropy: what a pipeline's last stage does, and
    other frameworks); reference: a preference run's reference model (tptrain dpo; its batch_size counts rows, two
    per pair): "copy" (a frozen copy sharded like the policy: its parameters, no gradients or optimizer states, and a
    forward per step), "adapters" (LoRA's base with the adapters off: a forward per step), "precomputed" (none while
    training); None: not a preference run. images_per_sample / image_size: a vision-language model's images (or an
    image's tiles, for families that cut one into tiles) per sequence, and their side in pixels (default: the tower's
    own size), which its vision tower turns into (side / patch)^2 tokens each. final_save: the run ends by writing
    the consolidated model (`tptrain train`'s final/; the Trainer's save_model): the parameters gathered one at a
    time, the writer holding one shard file's tensors in host memory; False: one training step only."""

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
    reference: str | None = None
    images_per_sample: int = 1
    image_size: int | None = None
    final_save: bool = True

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len"):
            check_positive_int(getattr(self, name), "--" + name.replace("_", "-"))
        if self.images_per_sample < 0 or self.image_size is not None and self.image_size < 1:
            raise ValueError(f"--images-per-sample must be >= 0 and --image-size >= 1, got {self.images_per_sample} "
                             f"and {self.image_size}")
        if self.lora_r < 0:
            raise ValueError(f"--lora-r must be >= 0, got {self.lora_r}")
        if self.loss not in ("fused", "logits"):
            raise ValueError(f"loss must be 'fused' or 'logits', got {self.loss!r}")
        if self.reference not in (None, *REFERENCES):
            raise ValueError(f"--reference must be one of {', '.join(REFERENCES)}, got {self.reference!r}")

    def microbatches(self, pp: int) -> int:
        return self.pp_microbatches or pp if pp > 1 else 1

    def as_dict(self) -> dict:
        out = asdict(self)
        out["dtype"] = dtype_name(self.dtype)
        return out
