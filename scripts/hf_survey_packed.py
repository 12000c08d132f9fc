"""The survey's packed column (`hf_checkpoint_survey.py --packed`): does a packed row train as its documents alone?

Two rows of packed documents made of a type's ids (5 + 7 and 4 + 4 + 4 tokens, position ids restarting at each, the
first label of each -100 as packing makes it), on tp x cp ranks (the transformers backend), against transformers on
one process running each document alone, both in the steps stage's dtype (fp64 unless the checkpoint is large) under
`fp64_throughout`:

    load    tptrain's from_pretrained at the layout
    packed  the loss (summed over the documents' real tokens) within the steps stage's bound, this rank's logits
            (relative error, as the forward stage) and every gradient (gathered over tp; relative to its largest
            entry, or 1% of the model's largest, as the backward stage) within 1e-5

Only the types that mix tokens outside attention need it (their token mixers run on each document as a row of its own:
tptrain/hf/documents.py), and those whose transformers code builds its masks without the position ids (tptrain's
masks then): `packed_types()`; attention alone keeps packed documents apart through its masks.
"""
from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from hf_survey_stages import LOSS_RTOL, _stage, eager_experts, fp64_throughout, relative_error

PACKED_STAGES = ("load", "packed")
ROWS = ((5, 7), (4, 4, 4))  # the documents of each row (the survey's ids are (2, 12))
PACKED_RTOL = 1e-5


def packed_types(types: list[str], tiny_config) -> list[str]:
    """Of `types`, those a packed row can go wrong on outside attention's masks (built on meta): a token mixer
    outside attention, a refusal of packed documents, or masks transformers builds without the position ids."""
    from tptrain.hf.model import TransformersCausalLM

    out = []
    for model_type in types:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = TransformersCausalLM.from_config(tiny_config(model_type), device="meta")
        except Exception:  # noqa: BLE001 - a type transformers cannot build: the survey reports it
            out.append(model_type)
            continue
        if model._packed.mixers or model.packing_refusal or model.config._attn_implementation == "tptrain":
            out.append(model_type)
    return out


def packed_batch(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The (2, 12) ids as two rows of packed documents (ROWS): ids, labels (each document's first -100), positions."""
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ROWS])
    labels = ids.masked_fill(positions == 0, -100)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _documents(batch: dict[str, torch.Tensor]):
    for r, row in enumerate(ROWS):
        start = 0
        for n in row:
            yield r, slice(start, start + n)
            start += n


def _summed_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss summed (not averaged) over the real targets, in fp32 at least."""
    logits = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum")


def packed_reference(model, ids: torch.Tensor, dtype: torch.dtype) -> dict:
    """transformers on one process (a copy of `model` in `dtype`, eval mode), each document of `packed_batch(ids)`
    alone: its logits in the rows' layout, the loss over the rows' real tokens, every gradient."""
    batch = packed_batch(ids)
    count = int((batch["labels"][:, 1:] != -100).sum())
    train = copy.deepcopy(model).to(dtype).eval()
    eager_experts(train)
    logits, loss = None, 0.0
    with fp64_throughout():
        for r, span in _documents(batch):
            out = train(input_ids=ids[r:r + 1, span], use_cache=False).logits
            logits = torch.zeros(*ids.shape, out.shape[-1], dtype=out.dtype) if logits is None else logits
            logits[r, span] = out[0].detach()
            loss = loss + _summed_ce(out, batch["labels"][r:r + 1, span]) / count
    loss.backward()
    grads = {n: p.grad for n, p in train.named_parameters() if p.grad is not None}
    return dict(logits=logits, loss=loss.item(), grads=grads, loss_dtype=logits.dtype)


def run_packed_stages(directory, ids: torch.Tensor, ref: dict | None, *, tp: int, cp: int,
                      steps_dtype: torch.dtype) -> dict:
    """{stage: outcome} of PACKED_STAGES (and "error"), the same on every rank; `ref` is rank 0's (None elsewhere)."""
    from tptrain import AutoModelForCausalLM, DistributedConfig
    from tptrain.parallel.context_parallel import gather_sequence
    from tptrain.parallel.tensor_parallel import gather_full

    rank = torch.distributed.get_rank()
    state: dict = {}
    out: dict = {}

    def load():
        layout = dict(distributed_config=DistributedConfig(tp_size=tp, cp_size=cp, backend="transformers")) \
            if tp * cp > 1 else dict(backend="transformers")
        state["model"] = AutoModelForCausalLM.from_pretrained(directory, dtype=steps_dtype, **layout).eval()
        eager_experts(state["model"].hf_model)

    def packed():
        model, batch = state["model"], packed_batch(ids)
        count = int((batch["labels"][:, 1:] != -100).sum())
        with fp64_throughout():
            loss = model(**batch, num_items_in_batch=count).loss
            loss.backward()
            with torch.no_grad():  # (without labels: the logits whole over the vocabulary under TP)
                logits = model(batch["input_ids"], position_ids=batch["position_ids"]).logits
        cp_context, layout = model.parallel.cp, model.parallel.tp
        logits = logits if cp_context is None else gather_sequence(logits, cp_context)
        grads = {n: p.grad if layout is None else gather_full(p.grad, layout.specs[n], layout.ctx)
                 for n, p in model.named_parameters() if p.grad is not None}
        if rank == 0:
            _check(loss.item(), logits, grads, ref)

    try:
        for name, fn in zip(PACKED_STAGES, (load, packed)):
            out[name] = _stage(name, fn, out)
    finally:
        state.clear()
    return out


def _check(loss: float, logits: torch.Tensor, grads: dict, ref: dict) -> None:
    """AssertionError naming the first of the loss, the logits and the gradients that differs from the documents
    alone."""
    if abs(loss - ref["loss"]) > LOSS_RTOL[ref["loss_dtype"]] * abs(ref["loss"]):
        raise AssertionError(f"loss {loss:.10f} != the documents alone {ref['loss']:.10f}")
    if (err := relative_error(logits, ref["logits"])) > PACKED_RTOL:
        raise AssertionError(f"logits differ from the documents alone: relative error {err:.1e}")
    floor = 0.01 * max(g.abs().max().item() for g in ref["grads"].values())  # as the backward stage's
    bad = sorted(set(grads) ^ set(ref["grads"]))
    bad += [f"{n}: relative error {e:.1e}" for n, g in grads.items() if n in ref["grads"]
            and (e := relative_error(g, ref["grads"][n], floor=floor)) > PACKED_RTOL]
    if bad:
        raise AssertionError(f"{len(bad)} gradients differ from the documents alone: " + "; ".join(bad[:3]))
