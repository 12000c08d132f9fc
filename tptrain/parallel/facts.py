"""What the rule table (tptrain/layout) needs to know of a model, read once from the model as plain values; and the
axes a loaded model was laid out on (what the Trainer reads instead of being told them again)."""
from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from tptrain.distributed.state import state_of
from tptrain.layout import ModelFacts
from tptrain.parallel import contract


def model_facts(model: Any, objects: Mapping[str, Any] | None = None) -> ModelFacts | None:
    """The facts of `model` (whole, or cut into this rank's stages; on meta or not). `objects`: the style objects
    of its resolved plan ({module name: style}), which say which modules are experts (unknown without them). None
    for what is not a module (no facts to read)."""
    if not isinstance(model, nn.Module):
        return None
    config = getattr(model, "config", None)
    # (a vision-language model's tower attends before the sequence is split: context parallelism leaves it alone)
    attention = {name: m for name, m in model.named_modules() if isinstance(m, contract.TPAttention)
                 and contract.in_sequence(model, name)}
    base = contract.base_model(model)
    experts = None if objects is None else sum(1 for style in objects.values() if style.stacked_experts)
    return ModelFacts(
        name=type(model).__name__, model_type=str(getattr(config, "model_type", "?")),
        backend=getattr(model, "backend", "native"), num_layers=_num_layers(model), attention=len(attention),
        pp_refusal=contract.pipeline_refusal(model), sp_refusal=contract.sequence_parallel_refusal(model),
        without_attend=tuple((name, type(m).__name__) for name, m in attention.items() if contract.attend(m) is None),
        mask_builder=None if contract.mask_builder(model) is not None else
        f"{type(base).__name__} at {contract.prefix(model)!r}",
        sequence_mixers=tuple(contract.sequence_mixers(model).items()),
        whole_sequence=tuple(contract.whole_sequence_modules(model).items()),
        experts=experts, ep_plan=bool(contract.model_ep_plan(model)) if config is not None else False)


def _num_layers(model: nn.Module) -> int | None:
    """The decoder layers of a model a pipeline can cut (of its whole model when it is cut already), or None."""
    plan = state_of(model).pp
    if plan is not None:
        return sum(len(stage) for stage in plan.stage_layers)
    parts = contract.pipeline_parts(model)
    return None if parts is None else len(model.get_submodule(parts[0]))


def laid_out(model: Any) -> dict[str, Any]:
    """The axes `model` was laid out on when it was loaded ({tp_size, ep_size, cp_size, pp_size, pp_schedule,
    sequence_parallel}): what a Trainer of it trains at. A model never laid out: every axis 1."""
    state = state_of(model)
    return {"tp_size": state.dims.tp, "ep_size": state.dims.ep, "cp_size": state.dims.cp, "pp_size": state.dims.pp,
            "pp_schedule": state.pp.schedule if state.pp is not None else "1F1B",
            "sequence_parallel": state.sequence_parallel}
