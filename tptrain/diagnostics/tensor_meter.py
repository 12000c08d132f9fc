"""LiveTensorBytes: the tensor bytes alive on this process while it is active, and their peak (what
`benchmarks/bench_plan.py` measures the planner against; torch's MemTracker counts the same, but refuses a module
called several times in one step, as a pipeline's microbatches call their stage).

    with LiveTensorBytes(existing=[*model.parameters(), *optimizer_states]) as meter:
        trainer.training_step(batch)
    meter.peak        # bytes
"""
from __future__ import annotations

import weakref
from typing import Iterable

import torch


class LiveTensorBytes:
    """The tensor bytes alive on this rank while active, and their peak: every op's outputs (a TorchDispatchMode),
    each storage counted once from its creation to its release (weak references), storage resizes (FSDP2 frees a
    gathered parameter with resize_(0)) followed; `existing` tensors counted from the start."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        from torch.distributed._tools.common_utils import get_untyped_storages
        from torch.utils.weak import WeakIdKeyDictionary

        self._storages, self._ids, self._sizes = get_untyped_storages, WeakIdKeyDictionary(), {}
        self.current = self.peak = 0
        for t in existing:
            self.track(t)

    def track(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        for st in self._storages(t):
            if st not in self._ids:
                ref = weakref.ref(st, self._free)  # kept in _sizes: a dropped weakref never calls back
                self._ids[st], self._sizes[id(ref)] = id(ref), [ref, st.nbytes()]
                self.current += st.nbytes()
        self.peak = max(self.peak, self.current)

    def _free(self, ref) -> None:
        self.current -= self._sizes.pop(id(ref), (None, 0))[1]

    def _resized(self, st) -> None:
        key = self._ids.get(st)
        if key is not None:
            self.current += st.nbytes() - self._sizes[key][1]
            self._sizes[key][1] = st.nbytes()
            self.peak = max(self.peak, self.current)

    def __enter__(self):
        from torch.distributed.tensor import DTensor
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        meter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(t is DTensor for t in types):
                    return NotImplemented  # DTensor runs first, its local ops come back here
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    meter.track(t)
                return out

        self._resize = original = torch.UntypedStorage.resize_

        def resize_(st, size):
            out = original(st, size)
            meter._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize
