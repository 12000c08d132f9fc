"""The reference models a preference run holds or runs once: a frozen copy laid out like the policy, the forward of
a reference through its pipeline, and precompute_ref_log_probs (every pair's reference log-probabilities, computed
once before training and stored beside the data cache).

    ref = frozen_copy(trainer, None)           # loaded from the policy's checkpoint, its layout, the Trainer's mesh
    precompute(trainer, reference)             # trainer.dataset.ref_logps: (pairs, 2), every rank
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tptrain.distributed import ParallelDims, comm
from tptrain.distributed.state import state_of
from tptrain.distributed.topology import dp_mesh
from tptrain.parallel.parallelize import ParallelOptions, adopt_mesh, parallelize


def frozen_copy(trainer: Any, ref_model: nn.Module | None) -> nn.Module:
    """`ref_model`, or (None) the policy's checkpoint loaded again with the policy's layout (its DistributedConfig)
    and dtype: every parameter frozen, moved onto the Trainer's mesh and given the training run's data parallelism
    (FSDP2 shards it over dp like the policy; under pp its own stages and schedule, `.pipeline`)."""
    policy = trainer.inner
    if ref_model is None:
        from tptrain.models import AutoModelForCausalLM

        dtype = next(policy.parameters()).dtype
        ref_model = AutoModelForCausalLM.from_pretrained(policy.name_or_path, dtype=dtype,
                                                         distributed_config=state_of(policy).config)
    mine, theirs = state_of(policy), state_of(ref_model)
    if (theirs.dims.tp, theirs.dims.cp, theirs.dims.pp, theirs.dims.ep) != (mine.dims.tp, mine.dims.cp, mine.dims.pp,
                                                                           mine.dims.ep):
        raise ValueError(f"ref_model is laid out as {theirs.dims.sizes()} but the model as {mine.dims.sizes()}; "
                         "load the reference with the model's DistributedConfig")
    for p in ref_model.parameters():
        p.requires_grad_(False)
    if theirs.laid_out and ParallelDims.of(theirs.mesh) != ParallelDims.of(trainer.mesh):
        adopt_mesh(ref_model, trainer.mesh)
    config = trainer.args.parallelism_config
    options = ParallelOptions(train=True, bf16=trainer.args.bf16,
                              pp_microbatches=config.pp_microbatches if config is not None else None)
    done = parallelize(ref_model, trainer.mesh, options, device=trainer.device)
    ref_model.pipeline = done.pipeline
    return ref_model.train()  # the chunked head (training mode), under no_grad: as the policy's forward


def reference_forward(pipeline: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(rows,) each row's summed log-probability through `pipeline` (forward only): on the last stage's ranks, zeros
    elsewhere; each cp rank's share summed by the pipeline's step."""
    pipeline.loss.objective = _negated
    try:
        rows = batch["lengths"].to(torch.float64).unsqueeze(-1)  # any per-row tensor: only its split is read
        return pipeline.step(batch, 0, train=False, rows=rows, per_row=True)
    finally:
        pipeline.loss.objective = None


def _negated(per_sequence_loss: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return -per_sequence_loss


def precompute(trainer: Any, reference: Any) -> None:
    """Every training pair's reference log-probabilities, (pairs, 2) on every rank in `trainer.dataset.ref_logps`:
    read from beside the data cache when stored there for this reference, else one forward per pair (each dp rank
    a share, the same number of forwards on every rank), summed over dp and pp, and stored (rank 0)."""
    data = trainer.dataset
    path = _stored_path(trainer)
    if path is not None and path.is_file():
        data.ref_logps = np.load(path)
        return
    device = trainer.device
    out = torch.zeros(len(data), 2, dtype=torch.float64, device=device)
    for indices in _shares(trainer):
        batch = trainer._batch([data[i] for i in indices])
        logps = reference.log_probs(batch).to(torch.float64)
        out[batch["pairs"]] = _per_pair(logps, len(indices), groups=_groups(trainer))
    comm.all_reduce(out, dp_mesh(trainer.mesh).get_group())
    if trainer.pipeline is not None:
        comm.all_reduce(out, trainer.mesh["pp"].get_group())
    data.ref_logps = out.cpu().numpy()
    if path is not None and trainer.is_rank0:
        _save(path, data.ref_logps)


def _groups(trainer: Any) -> int:
    return trainer.pipeline.n_microbatches if trainer.pipeline is not None else 1


def _shares(trainer: Any) -> list[list[int]]:
    """This dp rank's pairs (every dp-th) in batches, padded with its own pairs so that every dp rank runs the same
    number of forwards (FSDP2 and the pipeline need every rank in each) and each batch splits into the groups."""
    args, data = trainer.args, trainer.dataset
    size = args.per_device_train_batch_size if trainer.pipeline is not None else (
        args.precompute_ref_batch_size or args.per_device_train_batch_size)
    dp, rank = trainer.dims.dp, dp_mesh(trainer.mesh).get_local_rank()
    mine = list(range(rank, len(data), dp))
    largest = -(-len(data) // dp)  # the largest share's pairs, and its batches
    count = -(-largest // size)
    padded = mine + [mine[-1] if mine else 0] * (count * size - len(mine))
    return [padded[k:k + size] for k in range(0, count * size, size)]


def _per_pair(logps: torch.Tensor, pairs: int, *, groups: int) -> torch.Tensor:
    """(pairs, 2) the (chosen, rejected) log-probabilities of rows collated as `collate_pairs` orders them."""
    per_group = logps.view(groups, 2, pairs // groups)  # (group, chosen / rejected, pair in group)
    return per_group.permute(0, 2, 1).reshape(pairs, 2)


def _stored_path(trainer: Any) -> Path | None:
    """Where this reference's log-probabilities of the training set are stored: beside the data's token cache, named by
    the data's key and what the reference's forward depends on (its checkpoint files, dtype, the run's max_length,
    max_prompt_length, truncation, bf16); None when either cannot be named (data not cached, a model in memory)."""
    from tptrain.training.token_cache import cache_root

    data, args = trainer.dataset, trainer.args
    name = getattr(trainer.inner, "name_or_path", None) if trainer.ref_model is None else \
        getattr(trainer.ref_model, "name_or_path", None)
    if data.data_key is None or name is None or not Path(name).is_dir():
        return None
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(name).iterdir() if p.is_file())
    parts = {"data": data.data_key, "model": str(Path(name).resolve()), "files": files,
             "dtype": str(next(trainer.inner.parameters()).dtype), "max_length": args.max_length,
             "max_prompt_length": args.max_prompt_length, "truncation_mode": args.truncation_mode, "bf16": args.bf16}
    key = hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=16).hexdigest()
    return cache_root(args.data_cache_dir)[0] / f"ref-logps-{key}.npy"


def _save(path: Path, values: np.ndarray) -> None:
    """Written atomically (a temporary file renamed into place); a cache that cannot be written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, values)
        os.replace(tmp, path)
    except OSError as exc:
        print(f"tptrain: the reference log-probabilities were not stored in {path.parent} ({exc})", flush=True)
