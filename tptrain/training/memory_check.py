"""Every run checks the planner: each rank's measured peak memory beside `tptrain plan --train`'s for the same model,
layout and run, printed at the end of training and written to metrics.jsonl.

    release_freed_memory()                    # before the model is built: freed tensors leave the process's memory
    check = MemoryCheck(model, args, dims, device, mesh=mesh)   # the plan's peak for this rank
    check.report(reporter, optimizer)         # collective, at the end: every rank's figures, printed and logged

Measured: on CUDA the caching allocator's reserved peak (`torch.cuda.max_memory_reserved`: what decides whether a
run fits), on CPU the process's peak resident set (VmHWM: what a monitor and the OOM killer see). Planned: the
planner's peak of this rank's pipeline stage (tensors), plus, on CPU, the runtime's own resident memory (interpreter,
libraries, gloo, the data, the threads' stacks), measured at the end as the resident set less the tensors alive.

glibc's malloc gives a large block its own mmap, unmapped when freed, only above a threshold that starts at 128 KiB
and grows to the size of each such block freed (up to 32 MiB); below it (most activations, once it has grown) freed
blocks stay in the heap, fragmented, and RSS exceeds the live tensors by a fifth to a half (measured:
docs/planning.md). `release_freed_memory` fixes the threshold at 128 KiB: RSS then follows the tensors, and the plan
predicts it. The price on CPU: every large tensor's pages are faulted in fresh (up to a third more CPU time per
step of a 1-thread rank; TPTRAIN_RELEASE_FREED_MEMORY=0 keeps glibc's default). On CUDA the caching allocator is
asked for expandable segments (unless PYTORCH_CUDA_ALLOC_CONF says otherwise): freed blocks are reused across sizes,
so its reserved peak stays near the tensors' (torchtitan runs so).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from tptrain.distributed import comm

MMAP_THRESHOLD = 128 * 1024  # bytes: larger blocks are mmapped alone and unmapped when freed
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MiB = 2**20


def release_freed_memory() -> bool:
    """Fix glibc malloc's mmap threshold at MMAP_THRESHOLD (this process, from now on: freed tensors' memory goes back
    to the OS) and ask the CUDA caching allocator, not yet started, for expandable segments. Returns whether glibc took
    the threshold: False off glibc, when MALLOC_MMAP_THRESHOLD_ already says, or with TPTRAIN_RELEASE_FREED_MEMORY=0
    (glibc's default kept: faster on CPU, RSS above the plan)."""
    if not torch.cuda.is_initialized():
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if (not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ
            or os.environ.get("TPTRAIN_RELEASE_FREED_MEMORY") == "0"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def _status(field: str) -> int | None:
    """A /proc/self/status size in bytes (VmHWM, VmRSS), None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measured_peak(device: torch.device) -> int:
    """This process's peak so far: the CUDA caching allocator's reserved peak on `device`, else its peak resident set
    (VmHWM; getrusage's ru_maxrss where there is no /proc)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device)
    peak = _status("VmHWM")
    if peak is None:
        import resource  # Unix only

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return peak


def runtime_memory(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """What this process holds beside `tensors` (those alive now: the model's, the optimizer's states) now: on CPU
    its resident set less their bytes (each storage once); on CUDA 0 (the allocator's figures count tensors only)."""
    if device.type == "cuda":
        return 0
    storages = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.device.type == "cpu" and local.numel():
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return max(0, (_status("VmRSS") or 0) - sum(storages.values()))


def live_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    """The tensors a run keeps between steps: the model's parameters, buffers and gradients, the optimizer's states."""
    for t in [*model.parameters(), *model.buffers()]:
        yield t
        if getattr(t, "grad", None) is not None:
            yield t.grad
    for state in (optimizer.state.values() if optimizer is not None else ()):
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def planned_peak(model: nn.Module, args: Any, dims: Any, *, pp_rank: int, device: torch.device) -> int:
    """The planner's peak tensor memory of this rank (its pipeline stage's) for this model, layout and run: what
    `tptrain plan --train --layout ...` says for it. Raises ValueError where the planner cannot model the run."""
    from tptrain.diagnostics.memory_plan import rank_memory
    from tptrain.diagnostics.model_shapes import ModelShapes
    from tptrain.diagnostics.train_settings import TrainSettings
    from tptrain.distributed.state import state_of
    from tptrain.parallel.facts import laid_out

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    fixed, lora = laid_out(inner), getattr(model, "peft_config", {}).get("default")
    dtype = next(inner.parameters()).dtype if lora is None else _base_dtype(inner)
    pp_config, reference = args.parallelism_config, _reference(args, lora)
    rows = (2 if reference else 1) * args.per_device_train_batch_size  # a preference pair: two rows
    settings = TrainSettings(batch_size=rows, seq_len=args.seq_len, dtype=dtype, bf16=args.bf16,
                             gradient_checkpointing=args.gradient_checkpointing, lora_r=getattr(lora, "r", 0),
                             optim_in_backward=args.optim_in_backward, pp_schedule=fixed["pp_schedule"],
                             pp_microbatches=pp_config.pp_microbatches if pp_config is not None else None,
                             sequence_parallel=fixed["sequence_parallel"],
                             expert_parallel=bool(getattr(state_of(inner).config, "enable_expert_parallel", False)),
                             reference=reference)
    shapes = ModelShapes.of(inner.config, dtype=dtype)
    return rank_memory(shapes, dims, settings, device=device.type)[pp_rank].peak


def _reference(args: Any, lora: Any) -> str | None:
    """The reference a preference run (a DPOConfig: two rows a pair) holds, as `tptrain plan --reference` names it;
    None for plain training."""
    if not hasattr(args, "needs_reference"):
        return None
    if args.precompute_ref_log_probs or args.reference_free or not args.needs_reference:
        return "precomputed"
    return "adapters" if lora is not None else "copy"


def _base_dtype(model: nn.Module) -> torch.dtype:
    frozen = [p.dtype for p in model.parameters() if not p.requires_grad]
    return frozen[0] if frozen else next(model.parameters()).dtype


class MemoryCheck:
    """This rank's planned peak: the planner's for its stage, plus on CPU the runtime's own memory (its resident set
    less the tensors alive, measured at `report`: after the final save, every import and thread the run made); and
    its measured one."""

    def __init__(self, model: nn.Module, args: Any, dims: Any, device: torch.device, *, mesh: Any) -> None:
        """Also `release_freed_memory` (before the training allocates anything)."""
        release_freed_memory()
        pp_rank = mesh["pp"].get_local_rank() if dims.pp > 1 else 0
        self.model, self.device = model, device
        self.kind = "CUDA reserved" if device.type == "cuda" else "max RSS"
        try:
            self.planned, self.why_not = planned_peak(model, args, dims, pp_rank=pp_rank, device=device), None
        except Exception as exc:  # noqa: BLE001 - a diagnostic: the run goes on and says why there is no plan
            self.planned, self.why_not = None, f"{type(exc).__name__}: {exc}"

    def figures(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """This rank's {"measured", "planned" (None: no plan), "runtime"}, in bytes."""
        measured = measured_peak(self.device)
        runtime = runtime_memory(live_tensors(self.model, optimizer), self.device)
        return {"measured": measured, "planned": None if self.planned is None else self.planned + runtime,
                "runtime": runtime}

    def report(self, reporter: Any, optimizer: torch.optim.Optimizer | None = None) -> list[dict[str, Any]]:
        """Every rank's figures (collective), printed by rank 0 and added to metrics.jsonl's last record as
        peak_memory / planned_peak_memory (per rank, bytes); returns them."""
        ranks = comm.all_gather_object(self.figures(optimizer))
        if reporter is not None and reporter.enabled:
            print(self.text(ranks), flush=True)
            reporter.amend({"peak_memory": [r["measured"] for r in ranks],
                            "planned_peak_memory": [r["planned"] for r in ranks],
                            "peak_memory_kind": "cuda_reserved" if self.device.type == "cuda" else "max_rss"})
        return ranks

    def text(self, ranks: list[dict[str, Any]]) -> str:
        what = "the planner's tensors" + ("" if self.device.type == "cuda" else " + the runtime's own memory")
        lines = [f"tptrain: peak memory per rank, measured ({self.kind}) vs planned ({what}):"]
        for rank, r in enumerate(ranks):
            plan = (f"planned {r['planned'] / MiB:,.0f} MiB, measured / planned {r['measured'] / r['planned']:.2f}"
                    if r["planned"] else f"no plan ({self.why_not})")
            lines.append(f"  rank {rank}: measured {r['measured'] / MiB:,.0f} MiB, {plan}")
        return "\n".join(lines)
