"""The model-engine contract's part for pipeline parallelism (parallel/contract.py holds the rest): what a model
offers to be cut into stages, and the accessors the engine reads it through (each default stated once, here)."""
from __future__ import annotations

from typing import Mapping, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class PipelineModel(Protocol):
    """What a model offers to be cut into pipeline stages (parallel/pipeline_parallel.py; absent: pp_size > 1 is
    refused, naming the model).

    pp_layers: the dotted name of the decoder-layer list (an nn.ModuleList; a stage keeps its own layers in an
        nn.ModuleDict keyed by their index, so every parameter keeps its whole-model name).
    pp_first: dotted names of the modules only the first stage holds (the embedding); the others hold None there.
    pp_last: dotted names of the modules only the last stage holds (the final norm and the head).
    pipeline_forward(x, *carried, position_ids=None, **inputs): the stage's computation on what the module holds:
        token ids or hidden states in, hidden states or logits out (the loss is computed from the logits by
        `loss_function`); or (output, *carried): tensors besides x each stage passes on to the next (the router
        statistics of the layers so far), `carried` being the stage before's (none on the first). The Pipeline
        always passes `position_ids` (batch, tokens), or (batch, rows, tokens) where `input_positions` gives
        multimodal ones: the sequence's length and positions come from them, not from `x`, which under sequence
        parallelism is a tp rank's shard of the hidden states. `inputs`: the batch's other inputs where it has any
        (a vision-language model's): those of one row per token on every stage, those of rows per sample (images,
        patches) on the first stage only, each the microbatch's own.
    Optional:
    pipeline_loss(loss, *carried) -> loss: the last stage's microbatch loss with what was carried (the router aux
        loss; needed when pipeline_forward carries anything).
    input_positions(input_ids, **inputs) -> (batch, rows, seq) or None: the whole batch's position ids where the
        model computes them from its inputs (`input_positions`; absent or None: 0..seq-1): multimodal RoPE's rows
        (time, height, width) from the ids and the image grids, which every stage needs and only the whole rows
        give.
    A model that is not one may say why (`pp_refusal`, a str; `pipeline_refusal`), which the refusal repeats.
    """

    pp_layers: str
    pp_first: tuple[str, ...]
    pp_last: tuple[str, ...]

    def pipeline_forward(self, x: torch.Tensor, *carried: torch.Tensor,
                         position_ids: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]: ...


def input_positions(model: nn.Module, input_ids: torch.Tensor, inputs: Mapping[str, torch.Tensor]
                    ) -> torch.Tensor | None:
    compute = getattr(model, "input_positions", None)
    return compute(input_ids, **inputs) if compute is not None else None


def pipeline_refusal(model: nn.Module) -> str | None:
    return getattr(model, "pp_refusal", None)


def pipeline_parts(model: nn.Module) -> tuple[str, tuple[str, ...], tuple[str, ...]] | None:
    """(layer list, first-stage modules, last-stage modules) of a `PipelineModel`; None if the model is not one."""
    return (model.pp_layers, tuple(model.pp_first), tuple(model.pp_last)) if isinstance(model, PipelineModel) else None
