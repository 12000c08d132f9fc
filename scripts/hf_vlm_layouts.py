"""The cp and pp stages of hf_vlm_survey.py (`--cp-size`, `--pp-size`): a vision-language model laid out with
context or pipeline parallelism (and tp), trained as tests/test_vlm_axes.py drives it, against transformers' own
training on one process (scripts/hf_survey_stages.py's reference of the same batch).

    load    tptrain.AutoModelForImageTextToText.from_pretrained at tp x cp x pp, in the steps' dtype (fp64)
    train   3 AdamW steps (lr / eps as the steps stage, no decay) on the survey's batch of 2 rows with the labels the
            ids: under cp the model's forward (the sequence split where it enters the text decoder, the batch's
            length a multiple of 2 x cp: `cp_batch`), under pp the Pipeline's step (one microbatch per row, each
            with its own image: `image_rows`); each loss within the steps stage's bound of transformers' own
    save    save_pretrained (from the stages under pp) after the 3 steps, reloaded by transformers: its loss on the
            batch is what transformers' own training's model, saved and reloaded, gives
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from hf_survey_stages import (EPS, LAYOUT_STAGES, LOSS_RTOL, LR, STEPS, _ce, _run, _stage, _without_noise,
                              eager_experts, fp64_throughout)

TEXT_IDS = (3, 100)  # the text tokens appended to a cp batch: below the config's special token ids


def cp_batch(inputs: dict[str, torch.Tensor], cp: int) -> dict[str, torch.Tensor]:
    """The survey's batch with text tokens appended up to a multiple of 2 x cp (and one such block more, as
    tests/test_vlm_axes.py's), every other per-token input (token type ids: 0 on text) extended alike."""
    ids = inputs["input_ids"]
    multiple = 2 * cp
    extra = -ids.shape[1] % multiple + multiple
    more = torch.randint(*TEXT_IDS, (ids.shape[0], extra), generator=torch.Generator().manual_seed(5))
    out = {k: torch.cat([v, torch.zeros(ids.shape[0], extra, dtype=v.dtype)], dim=1) if v.shape[:2] == ids.shape
           else v for k, v in inputs.items()}
    out["input_ids"] = torch.cat([ids, more], dim=1)
    return out


def image_rows(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{name + ROWS: how many of the input's rows each sample holds} for the inputs joined along dim 0 (an image's
    pixels, grids, sizes: not per token), which the Pipeline's microbatches split by sample."""
    from tptrain.distributed.state import ROWS

    ids = inputs["input_ids"]
    return {k + ROWS: torch.tensor([v.shape[0] // len(ids)] * len(ids)) for k, v in inputs.items()
            if v.dim() and v.shape[:2] != ids.shape}


def run_vlm_layout_stages(directory: Path, inputs: dict, ref: dict | None, *, tp: int, cp: int, pp: int,
                          steps_dtype: torch.dtype) -> dict:
    """{stage: outcome} of LAYOUT_STAGES, and "error" (the first failure's reason; a refusal by the rule table is the
    load stage's); the same on every rank. `ref` is rank 0's reference (None elsewhere)."""
    from tptrain.distributed import comm

    rank = torch.distributed.get_rank()
    state: dict = {}
    out: dict = {}
    tmp = comm.all_gather_object(tempfile.mkdtemp() if rank == 0 else None)[0]
    batch = {k: v.to(steps_dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    batch["labels"] = batch["input_ids"]

    def close(values, want, what):
        got, want = torch.tensor(values, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
        if not torch.allclose(got, want, rtol=LOSS_RTOL[ref["loss_dtype"]], atol=0):
            raise AssertionError(f"{what} {[f'{x:.10f}' for x in got.tolist()]} != transformers' on one process "
                                 f"{[f'{x:.10f}' for x in want.tolist()]}")

    def train():
        with fp64_throughout():
            losses = _train(state, batch)
        if rank == 0:
            close(losses, ref["losses"][:STEPS], f"losses of {STEPS} AdamW steps")

    def save():
        state["model"].save_pretrained(Path(tmp) / "final")
        if rank == 0:
            ref["trained"].save_pretrained(Path(tmp) / "transformers")
            close([_reloaded_loss(Path(tmp) / "final", inputs, steps_dtype)],
                  [_reloaded_loss(Path(tmp) / "transformers", inputs, steps_dtype)], "the reloaded checkpoint's loss")

    def load():
        state.update(_load(directory, steps_dtype, tp, cp, pp, len(inputs["input_ids"])))

    try:
        for name, fn in zip(LAYOUT_STAGES, (load, train, save)):
            out[name] = _stage(name, fn, out)
    finally:
        state.clear()
        comm.all_gather_object(None)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _load(directory: Path, dtype: torch.dtype, tp: int, cp: int, pp: int, rows: int) -> dict:
    """{"model": tptrain's model at the layout in train mode without dropout, "pipeline": its Pipeline (one
    microbatch per row) under pp, else None}."""
    from tptrain import AutoModelForImageTextToText, DistributedConfig
    from tptrain.parallel.parallelize import ParallelOptions, parallelize

    model = AutoModelForImageTextToText.from_pretrained(
        directory, dtype=dtype, distributed_config=DistributedConfig(tp_size=tp, cp_size=cp, pp_size=pp))
    eager_experts(getattr(model, "hf_model", model))
    model.train()
    _without_noise(model)  # the reference trains in eval mode
    pipeline = None
    if pp > 1:
        pipeline = parallelize(model, model.parallel.mesh, ParallelOptions(train=True, pp_microbatches=rows),
                               device=torch.device("cpu")).pipeline
    return {"model": model, "pipeline": pipeline}


def _train(state: dict, batch: dict[str, torch.Tensor]) -> list[float]:
    """STEPS AdamW steps of state's model on `batch` (through its pipeline where it has one): each step's loss."""
    from tptrain.distributed.state import state_of
    from tptrain.losses import shift_labels

    model, pipeline = state["model"], state["pipeline"]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    grad_sync = state_of(model).grad_sync
    losses = []
    for _ in range(STEPS):
        if pipeline is not None:
            loss = pipeline.step({**batch, **image_rows(batch)}, int((shift_labels(batch["labels"]) != -100).sum()))
            torch.distributed.all_reduce(loss, group=model.parallel.mesh["pp"].get_group())  # the last stage's
            pipeline.ties.sync_grads()
        else:
            loss = model(**batch).loss
            loss.backward()
        if grad_sync is not None:  # partial gradients summed over tp (as the Trainer's step)
            grad_sync.sync_grads(model)
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _reloaded_loss(directory: Path, inputs: dict, dtype: torch.dtype) -> float:
    """transformers' reload of `directory`: its loss on `inputs` (the labels the ids), in `dtype`."""
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(directory, dtype=dtype).to(dtype).eval()
    eager_experts(model)
    with fp64_throughout(), torch.no_grad():
        return _ce(_run(model, inputs, use_cache=False).logits, inputs["input_ids"]).item()
