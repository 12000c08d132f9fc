"""AdamW stepped inside backward, one parameter at a time, each gradient freed as soon as it is used.

    args = TrainingArguments(..., optim_in_backward=True, max_grad_norm=0)   # tptrain train --optim-in-backward

As torchtune's optimizer_in_bwd: every parameter has its own AdamW, stepped by the parameter's
post-accumulate-grad hook, after which `p.grad = None`, so at most the gradients autograd is still producing
are alive at once instead of the whole model's. Under FSDP2 the hook is on the sharded parameter, and FSDP2
runs it after its reduce-scatter (and HSDP's all-reduce) has put the summed shard in `.grad`.

Under pipeline parallelism a parameter's gradient is complete only after its stage's last microbatch (zero-bubble
schedules: its weight backward, which sets `.grad` itself) and FSDP2's reduce-scatter, which torch's schedule runs
once at the end of the stage's backward: no hook, the caller steps each stage's parameters then (`step_complete`,
called by `pipeline_grads.when_complete`).

TP partial gradients (replicated weights applied to sharded activations, shared KV chunks) are NOT whole when
their hook fires: the TP sum (parallel/grad_sync.py) runs once per step, after backward. Those parameters get no
hook; they keep their gradient until the caller has summed it and calls `step()`. They are the small ones (norms,
KV projections shared by several ranks), so the memory saving is kept for everything else, and every parameter
sees exactly the update of the ordinary optimizer.

What cannot be done in backward is refused by TrainingArguments: clipping (the global norm needs every gradient
before any step) and gradient accumulation (a step per micro-batch would not be one step on the whole batch).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tptrain.training.args import TrainingArguments
from tptrain.training.optim import adamw_kernels, param_groups


class OptimizerInBackward(torch.optim.Optimizer):
    """The ordinary optimizer's two groups (decayed, undecayed) as far as the schedule and checkpoints can tell:
    LambdaLR sets `param_groups[i]["lr"]`, which each parameter's AdamW reads when its hook fires; `state` is the
    one table every per-parameter AdamW writes to, keyed by parameter as torch.optim.AdamW's is, so a checkpoint
    holds the same tensors under the same names whichever optimizer wrote it (and resumes into either).

    `held_back`: names of parameters not stepped in backward (TP partial gradients, a pipeline's tied weight): `step()`
    steps them once the caller has summed their gradients. `hooks`: each parameter stepped by its gradient hook (False
    under pipeline parallelism: by `step_complete`)."""

    def __init__(self, model: nn.Module, args: TrainingArguments, *, held_back: Iterable[str] = (),
                 hooks: bool = True) -> None:
        defaults = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
        super().__init__(param_groups(model, args.weight_decay), dict(defaults, weight_decay=0.0))
        self._per_param: dict[nn.Parameter, tuple[torch.optim.AdamW, dict]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                opt = torch.optim.AdamW([p], **defaults, weight_decay=group["weight_decay"],
                                        **adamw_kernels(args.optim, [p]))
                opt.state = self.state  # one state table (distinct keys), read by checkpoints and state_dict()
                self._per_param[p] = (opt, group)
        held = set(held_back)
        self._held = {p for name, p in model.named_parameters() if name in held}
        for p in self._per_param if hooks else ():
            if p not in self._held:
                p.register_post_accumulate_grad_hook(self._step_param)

    @torch.no_grad()
    def _step_param(self, p: nn.Parameter) -> None:
        opt, group = self._per_param[p]
        opt.param_groups[0]["lr"] = group["lr"]  # the schedule's value for this step
        opt.step()
        p.grad = None  # freed now: the point of stepping in backward

    def step_complete(self, params: Iterable[nn.Parameter]) -> None:
        """Step `params`, their gradients complete (a pipeline stage's, its backward of the step over), but the held-back
        ones."""
        for p in params:
            if p in self._per_param and p not in self._held and p.grad is not None:
                self._step_param(p)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Step the parameters still holding a gradient after backward: the held-back ones, whose gradient the
        caller has summed over TP (the others were stepped, and their gradients freed, in backward)."""
        assert closure is None, "OptimizerInBackward takes no closure"
        for p in self._per_param:
            if p.grad is not None:
                self._step_param(p)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, then the per-parameter AdamWs are pointed at the new state table it installs."""
        super().load_state_dict(state_dict)
        for opt, _ in self._per_param.values():
            opt.state = self.state
