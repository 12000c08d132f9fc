"""A transformers-backend model's tensors beyond its parameters' conversions (conversions.py): the buffers a
checkpoint does not hold, computed after loading as transformers computes them, and the tensors a save writes, in the
hub's names and layout."""
from __future__ import annotations

import torch
import transformers
from torch import nn

from tptrain.hf.conversions import hub_sizes, save_groups, to_hub
from tptrain.parallel.saving import gathered_parameters


@torch.no_grad()
def materialise_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers still on meta (rotary inv_freq, Gemma's embed_scale: computed at init, not stored) computed by
    transformers' own `_init_weights` on the real device, as transformers does after loading: the loaded
    parameters are marked initialised, so its init functions leave them alone."""
    for name, module in model.named_modules():
        meta = [n for n, b in module.named_buffers(recurse=False) if b.device.type == "meta"]
        if not meta:
            continue
        for b in meta:  # NaN: a buffer the init leaves unwritten is caught below
            buf = module._buffers[b]
            module._buffers[b] = torch.full_like(buf, float("nan") if buf.is_floating_point() else 0, device=device)
        params = list(module.parameters())  # its init may write its children's too (SigLIP's position embedding)
        for p in params:
            p._is_hf_initialized = True
        try:
            init_owner(model, name)._init_weights(module)
        finally:
            for p in params:
                del p._is_hf_initialized
        unset = [b for b in meta if module._buffers[b].is_floating_point() and module._buffers[b].isnan().any()]
        if unset:
            raise ValueError(f"module {name!r} ({type(module).__name__}) has buffers {unset} that are not in "
                             f"the checkpoint and that transformers' _init_weights does not compute; tptrain's "
                             f"transformers backend cannot build them")


def hub_tensors(model: nn.Module, names: list[str], tied: dict[str, str]):
    """The model's `_checkpoint_tensors`: parameters gathered group by group and written under the hub's names and
    layout: transformers' own reverse of its load-time rules (a stacked expert tensor as per-expert tensors, renames
    undone); `tied`: {a last stage's copy: the first stage's name}, written under the latter (which that stage
    writes)."""
    layout = model.parallel.tp
    params = dict(model.named_parameters(remove_duplicate=False))
    # Persistent buffers are in transformers' checkpoints too (a router's e_score_correction_bias); never split.
    persistent = set(model.hf_model.state_dict(keep_vars=True))
    buffers = {n: b for n, b in model.named_buffers() if n in persistent}
    groups = save_groups(model.hf_model, [*names, *buffers])
    shapes = {n: (layout.global_shapes[n] if layout else tuple(params[n].shape), params[n].dtype)
              for n in names}
    shapes.update({n: (tuple(b.shape), b.dtype) for n, b in buffers.items()})
    sizes = {tied.get(k, k): v for k, v in hub_sizes(model.hf_model, groups, shapes).items()}

    def checkpoint_tensors():
        gathered = gathered_parameters(model, [n for group in groups for n in group if n not in buffers])
        for group in groups:
            tensors = {n: buffers[n].detach().cpu() if n in buffers else next(gathered)[1] for n in group}
            yield from ((tied.get(k, k), t) for k, t in to_hub(model.hf_model, tensors).items())

    return sizes, checkpoint_tensors


def init_owner(model: nn.Module, name: str) -> nn.Module:
    """The model whose `_init_weights` transformers applies to module `name`: the innermost transformers
    PreTrainedModel holding it (itself included), as its `initialize_weights` dispatches (Gemma 3n's text model
    reads its own `hidden_size`, which the causal LM around it lacks); else the causal LM."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = model.get_submodule(".".join(parts[:i]))
        if isinstance(module, transformers.PreTrainedModel):
            return module
    return model.hf_model
