"""Building modules on a device, on the meta device without running their initialisers (a leaf: torch only).

    with build_on(torch.device("meta")):
        model = LlamaForCausalLM(config)       # shapes only: no memory, no init; weights are read later per rank

Every model's construction goes through it: tptrain's `PreTrainedModel.from_config` and the transformers backend.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode


class SkipInit(TorchFunctionMode):
    """Make torch.nn.init.* no-ops. Meta tensors hold no values, and the meta kernel of normal_ would
    import torch._dynamo and sympy on first use (~2 s and ~70 MB per rank, on every load)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def build_on(device: torch.device) -> Iterator[None]:
    """Modules constructed inside are built on `device`; on the meta device with torch.nn.init.* skipped."""
    with device, (SkipInit() if device.type == "meta" else contextlib.nullcontext()):
        yield
