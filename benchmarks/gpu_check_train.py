"""gpu_check.py's train and fused parts: a few timed AdamW steps per implementation at this job's tp, and the fused
head + loss and the backward overlap against their unfused paths on one model."""
from __future__ import annotations

import gc
import importlib.util
import statistics
import time
import traceback

import torch

from tptrain import DistributedConfig
from tptrain.distributed import comm
from tptrain.models import AutoModelForCausalLM
from tptrain.parallel.data_parallel import apply_compile
from tptrain.training.mesh import compile_error


def _tptrain(run, *, parallel: bool):
    """The checkpoint in tptrain, over the whole job (parallel) or on this rank's device alone."""
    if parallel:
        return AutoModelForCausalLM.from_pretrained(run.meta["ckpt"], dtype=run.dtype,
                                                    distributed_config=DistributedConfig(tp_size=run.world))
    return AutoModelForCausalLM.from_pretrained(run.meta["ckpt"], dtype=run.dtype, device=run.device)


def _transformers(run):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(run.meta["ckpt"], dtype=run.dtype).to(run.device)


def _timed(run, step, n: int) -> tuple[list[float], list]:
    """Each of n calls of `step()` between barriers: this rank's seconds per call, and what each call returned."""
    times, outs = [], []
    for _ in range(n):
        comm.barrier()
        run.sync()
        t0 = time.perf_counter()
        outs.append(step())
        run.sync()
        times.append(time.perf_counter() - t0)
    return times, outs


def _summary(run, times: list[float], loss0: float) -> dict:
    """Step time = median over steps of the slowest rank; peak memory = the largest rank's."""
    ranks = comm.all_gather_object(dict(times=times, peak=run.peak()))
    step = statistics.median(max(t) for t in zip(*(r["times"] for r in ranks)))
    peaks = [r["peak"] for r in ranks if r["peak"] is not None]
    return dict(step_s=step, tok_s=run.tokens / step, peak=max(peaks) if peaks else None,
                loss0=loss0)


def _free(run) -> None:
    gc.collect()
    run.reset_peak()


def _guarded(run, part: str, case: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), or a FAIL row naming the exception (and None); the part goes on with its next row."""
    result = None
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - this row failed, the others still run
        traceback.print_exc()
        run.emit(part, case, check="FAIL", note=f"rank {run.rank}: {type(exc).__name__}: {exc}".splitlines()[0])
    _free(run)
    return result


def _train_row(run, case: str, load, *, warmup: int) -> None:
    """`warmup` + steps AdamW steps on the same batches as every other row; one row of the table."""
    model = load()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = iter([run.batch(i) for i in range(warmup + run.args.steps)])

    def step():
        ids, labels = next(batches)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    times, losses = _timed(run, step, warmup + run.args.steps)
    run.emit("train", case, tol=run.tol(), **_summary(run, times[warmup:], losses[0].item()))


def _compiled(run):
    model = _tptrain(run, parallel=False)
    apply_compile(model, backend="inductor")  # each decoder layer, as TrainingArguments(torch_compile=True) does
    return model


def train_part(run) -> None:
    """tp = the job's ranks. At tp 1: tptrain eager, transformers' own model (same GPU, plain AdamW loop), tptrain
    with each decoder layer compiled (compiled in an extra untimed step); at tp 2 or more: tptrain."""
    rows = [("tptrain", lambda: _tptrain(run, parallel=run.world > 1), 0, None)]
    if run.world == 1:
        no_peer = None if importlib.util.find_spec("transformers") else "transformers is not installed"
        no_compile = "dry run" if run.args.dry_run else compile_error("inductor", run.device)
        rows += [("transformers", lambda: _transformers(run), 0, no_peer),
                 ("tptrain + torch.compile (inductor)", lambda: _compiled(run), 1, no_compile)]
    for case, load, compile_steps, skipped in rows:
        if skipped:
            run.emit("train", case, check=f"skipped: {skipped}")
            continue
        _guarded(run, "train", case, _train_row, run, case, load, warmup=run.args.warmup + compile_steps)


def _grads(model, ids, labels, extra: dict) -> dict[str, torch.Tensor]:
    """{"loss": loss, name: local gradient} of one forward + backward (left zeroed)."""
    loss = model(input_ids=ids, labels=labels, **extra).loss
    loss.backward()
    out = {"loss": loss.detach()} | {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _compare(run, got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
    """check/err/note fields: every tensor within the tolerance x its largest reference magnitude, on every rank."""
    err, worst, note = 0.0, 0.0, ""
    for name, r in ref.items():
        g = got.get(name)
        if g is None or g.shape != r.shape:
            worst, note = float("inf"), f"{name}: {None if g is None else tuple(g.shape)} vs {tuple(r.shape)}"
            continue
        e = (g.float() - r.to(g.device).float()).abs().max().item()
        rel = e / max(r.abs().max().item(), 1e-30)
        err = max(err, e)
        if rel > worst:
            worst, note = rel, f"{name}: max abs err {e:.3g}, relative {rel:.3g}"
    ranks = comm.all_gather_object((err, worst, note))
    failed = [f"rank {i}: {n}" for i, (_, w, n) in enumerate(ranks) if w > run.tol()]
    return dict(check="FAIL" if failed else "ok" + (" (bit-identical)" if max(w for _, w, _ in ranks) == 0 else ""),
                err=max(e for e, _, _ in ranks), tol=run.tol(), note="; ".join(failed))


def _watch_blocks(model) -> list[bool]:
    """A list each colwise block member's forward appends to: whether its output came from a fused block."""
    seen: list[bool] = []

    def hook(module, args, out):
        seen.append(out.grad_fn is not None and out.grad_fn.name() == "_ArrivalBackward")  # colwise_block.take

    for m in model.modules():
        if id(m) in model.parallel.tp.ctx.blocks:
            m.register_forward_hook(hook)
    return seen


def _engaged(seen: list[bool], overlap: bool) -> dict:
    """A FAIL if the overlap's switch did not decide the path: on, every block fused; off, none."""
    fused = sum(seen)
    if fused == (len(seen) if overlap else 0) and (seen or not overlap):
        return {}
    return dict(check="FAIL", note=f"overlap {'on' if overlap else 'off'}, yet {fused} of {len(seen)} colwise outputs "
                                   f"came from a fused block (colwise_block.fusable)")


def _variant(run, model, seen: list[bool], batch, case: str, extra: dict, overlap: bool, ref: dict | None) -> dict:
    """One row of the fused part: its loss and gradients against `ref` (None: they become it), then timed. Returns
    the reference."""
    model.parallel.tp.ctx.overlap = overlap
    seen.clear()
    got = _grads(model, *batch, extra)
    if ref is None:  # the default path: the reference, off the GPU (not in the next rows' peak memory)
        ref = {n: t.cpu() for n, t in got.items()}
        check = dict(check=f"ok ({sum(seen)} of {len(seen)} colwise outputs from fused blocks)")
    else:
        check = _compare(run, got, ref)
    if not extra:  # the whole logits' head may or may not run as a block of one
        check.update(_engaged(seen, overlap))
    del got
    _free(run)
    times, _ = _timed(run, lambda: _grads(model, *batch, extra)["loss"], run.args.warmup + run.args.steps)
    run.emit("fused", case, **check, **_summary(run, times[run.args.warmup:], None))
    return ref


def fused_part(run) -> None:
    """The default path (fused head + loss, overlap on) as the reference; the whole logits and the overlap off each
    compared with it (loss and every gradient), and each timed (forward + backward)."""
    model = _tptrain(run, parallel=True)  # even at tp 1 (one GPU): the TP engine, over a group of one
    model.train()
    seen = _watch_blocks(model)
    alone = " (tp 1: trivial collective; overlap needs 2 GPUs)" if run.world == 1 else ""
    ref = _guarded(run, "fused", "default: fused head + loss, overlap on", _variant, run, model, seen, run.batch(0),
                   "default: fused head + loss, overlap on", {}, True, None)
    for case, extra, overlap in [("whole logits (return_logits=True) vs default", {"return_logits": True}, True),
                                 (f"overlap off (TPTRAIN_OVERLAP=0) vs default{alone}", {}, False)]:
        if ref is None:
            run.emit("fused", case, check="FAIL", note="no reference: the default path failed")
            continue
        _guarded(run, "fused", case, _variant, run, model, seen, run.batch(0), case, extra, overlap, ref)
