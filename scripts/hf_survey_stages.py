"""The stages `hf_checkpoint_survey.py` runs on one model type, on every rank of a gloo group: load, forward,
backward, steps, save, plan (tptrain at tp N) and peer (transformers' own TP at tp N), each against transformers on
one process (rank 0 holds that reference). A stage after a failed one is not run ("-").
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

STAGES = ("load", "forward", "backward", "steps", "save", "plan")
LAYOUT_STAGES = ("load", "train", "save")  # a layout with cp or pp (run_layout_stages)
FORWARD_RTOL = 1e-5  # the issue's: logits relative to transformers' on one process, fp32
# each gradient: within GRAD_RTOL of its largest entry plus GRAD_ATOL of the largest gradient entry of the model
# (fp32 sums in another order; a gradient that is 0 but for rounding, a normalised router's, is rounding on both sides)
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
# The steps run in fp64 on both sides (a layout bug is O(1) there; in fp32 AdamW's normalised step turns a gradient's
# rounding into a step of +-lr, so fp32 trajectories part at ~1e-5 without any bug), in fp32 for a checkpoint above
# FP64_MAX_BYTES (phi4_multimodal's full-size towers). transformers keeps fp32 islands in an fp64 model (Gemma's norms,
# eager attention's softmax, beam's softcapped logits), where TP's other summation order rounds differently:
# gemma4_unified_text's gradients at tp 4 part from one process's at 2e-7 with them, at 3e-14 without, and AdamW
# grows that to 1e-6 in the fourth loss. So both sides run under `fp64_throughout`; the islands it leaves (norms
# written `x.to(torch.float32)`, which it cannot tell from casts that must stay) move the losses by ~2e-9 (beam,
# qwen3_moe at tp 4): the bound is 1e-7, where a layout bug moves them by ~1e-2. The tolerance is the logits' dtype's.
LOSS_RTOL = {torch.float64: 1e-7, torch.float32: 1e-5}  # the loss of each of 3 AdamW steps (and the one after)
FP64_MAX_BYTES = 2**28
# AdamW's eps above fp32 rounding of a gradient that is 0 but for rounding (else each side steps it by +-lr at random);
# no weight decay (the Trainer, which the layout stages train with, decays no norm or bias; torch's AdamW all of them)
LR, EPS, STEPS = 1e-3, 1e-6, 3
PEER_MAX_BYTES = 2**30


def checkpoint_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))


@contextlib.contextmanager
def fp64_throughout():
    """fp64 tensors stay fp64 where a model casts them to fp32 by `x.float()` or a softmax with dtype=torch.float32:
    an fp64 model computed in fp64 but for casts spelled otherwise. Both sides of the steps stage run under it."""
    f64, f32 = torch.float64, torch.float32
    float_, softmax = torch.Tensor.float, F.softmax

    def keep_softmax(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=None if x.dtype == f64 and dtype is f32 else dtype)

    torch.Tensor.float = lambda self, *a, **k: self if self.dtype == f64 else float_(self, *a, **k)
    F.softmax = keep_softmax
    try:
        yield
    finally:
        torch.Tensor.float, F.softmax = float_, softmax


def steps_dtype(directory: Path) -> torch.dtype:
    """The dtype the steps stage trains in on both sides: fp64 unless the checkpoint is large."""
    return torch.float64 if checkpoint_bytes(directory) <= FP64_MAX_BYTES else torch.float32


def relative_error(got: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """max |got - ref| / max(max |ref|, floor): the error relative to the tensor's scale (not elementwise: a logit
    near 0 has no meaningful elementwise relative error in fp32)."""
    got, ref = got.detach().double(), ref.detach().double()
    if got.shape != ref.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != transformers' {tuple(ref.shape)}")
    scale = max(ref.abs().max().item(), floor)
    return (got - ref).abs().max().item() / (scale if scale > 0 else 1.0)


def _run(model, ids, **kwargs):
    """`model`'s forward on `ids`: token ids, or a dict of inputs under transformers' names (a vision-language model's
    pixels too), its floating inputs in the model's dtype."""
    inputs = ids if isinstance(ids, dict) else {"input_ids": ids}
    dtype = next(model.parameters()).dtype
    return model(**{k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}, **kwargs)


def _token_ids(ids) -> torch.Tensor:
    return ids["input_ids"] if isinstance(ids, dict) else ids


def _ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss without its model-specific extras (aux losses): shifted token mean, in fp32 at
    least."""
    logits = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def eager_experts(model) -> None:
    """transformers' experts through its batched_mm kernel: its grouped_mm kernels take no fp64, and the eager loop of
    some types (nemotron_h) indexes the expert-parallel sentinel id out of bounds."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("batched_mm")


def reference(model, ids, dtype: torch.dtype) -> dict:
    """transformers on one process (eval mode: no dropout on either side): logits and the first backward's
    gradients in fp32; the losses of STEPS AdamW steps and the one after, on a copy of `model` in `dtype` (fp32
    where transformers itself fails in fp64). "steps_dtype": the dtype trained in; "loss_dtype": the logits'
    (transformers may compute them in fp32 in an fp64 model: beam's softcapping), which sets the tolerance."""
    with torch.no_grad():
        logits = _run(model, ids, use_cache=False).logits
    train = copy.deepcopy(model).eval()
    _ce(_run(train, ids, use_cache=False).logits, _token_ids(ids)).backward()
    grads = {n: p.grad for n, p in train.named_parameters() if p.grad is not None}
    del train  # one copy at a time (phi4_multimodal's is 3.3 GB)
    try:
        losses, loss_dtype, trained = _trajectory(model, ids, dtype)
    except RuntimeError:
        if dtype == torch.float32:
            raise
        dtype = torch.float32  # inkling2_text: transformers' own fp64 forward mixes dtypes
        losses, loss_dtype, trained = _trajectory(model, ids, dtype)
    return dict(logits=logits, grads=grads, losses=losses, model=model, steps_dtype=dtype, loss_dtype=loss_dtype,
                trained=trained)


def _trajectory(model, ids, dtype: torch.dtype) -> tuple[list[float], torch.dtype, object]:
    """(the losses of STEPS AdamW steps and the one after, the logits' dtype, the model trained)."""
    same = dtype == next(model.parameters()).dtype  # trains `model` itself: the save stage reloads its weights
    train = model if same else copy.deepcopy(model).to(dtype).eval()
    eager_experts(train)
    with fp64_throughout():
        with torch.no_grad():
            loss_dtype = _run(train, ids, use_cache=False).logits.dtype
        return (train_losses(train, lambda m: _ce(_run(m, ids, use_cache=False).logits, _token_ids(ids))), loss_dtype,
                train)


def train_losses(model, loss) -> list[float]:
    """STEPS AdamW steps of `model` on `loss(model)`: its value before each and after the last."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)  # as the layout stage's Trainer
    losses = []
    for step in range(STEPS + 1):
        value = loss(model)
        losses.append(value.item())
        if step == STEPS:
            break
        value.backward()
        opt.step()
        opt.zero_grad()
    return losses


def run_stages(directory: Path, saved: Path, ids, ref: dict | None, tp_size: int, peer: bool, *,
               steps_dtype: torch.dtype, expert_parallel: bool = False, auto: str = "AutoModelForCausalLM") -> dict:
    """{stage: "OK" / "FAIL" / "-"} plus "error" (the first failure's reason) and "peer"; the same on every rank.
    `ref` is rank 0's (None elsewhere); `steps_dtype` its, on every rank. `expert_parallel`: tptrain's experts split
    by expert over the TP group (enable_expert_parallel); the peer stays transformers' plain TP. `ids`: token ids, or
    a dict of inputs; `auto`: the Auto class (tptrain's and transformers' alike) that loads the checkpoint (with
    AutoModelForImageTextToText, no plan stage: `tptrain plan` reads causal LMs)."""
    import transformers

    import tptrain
    from tptrain import DistributedConfig
    from tptrain.parallel.saving import gather_parameters
    from tptrain.parallel.tensor_parallel import gather_full

    rank = torch.distributed.get_rank()
    state: dict = {}
    out: dict = {}
    causal = auto == "AutoModelForCausalLM"

    def loaded(dtype):
        # the transformers backend, also for the types tptrain implements natively (tp 1: one device, no plan)
        layout = dict(distributed_config=DistributedConfig(tp_size=tp_size, backend="transformers",
                                                           enable_expert_parallel=expert_parallel)) \
            if tp_size > 1 else dict(backend="transformers") if causal else {}
        return getattr(tptrain, auto).from_pretrained(directory, dtype=dtype, **layout).eval()

    def load():
        state["model"] = loaded(torch.float32)

    def forward():
        with torch.no_grad():
            logits = _run(state["model"], ids).logits
        if rank == 0 and (err := relative_error(logits, ref["logits"])) > FORWARD_RTOL:
            raise AssertionError(f"logits differ from transformers': relative error {err:.2e} > {FORWARD_RTOL:.0e}")

    def backward():
        model = state["model"]
        loss = _run(model, ids, labels=_token_ids(ids)).loss
        loss.backward()
        layout = model.parallel.tp
        bad, count = [], 0
        largest = max(g.abs().max().item() for g in ref["grads"].values()) if rank == 0 else 0.0
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            grad = p.grad if layout is None else gather_full(p.grad, layout.specs[name], layout.ctx)
            if not torch.isfinite(grad).all():
                bad.append(f"{name}: not finite")
            if rank == 0:
                count += 1
                want = ref["grads"].get(name)
                if want is None:
                    bad.append(f"{name}: transformers has no gradient")
                elif (err := relative_error(grad, want, floor=GRAD_ATOL / GRAD_RTOL * largest)) > GRAD_RTOL:
                    bad.append(f"{name}: relative error {err:.1e}")
        if rank == 0:
            missing = sorted(set(ref["grads"]) - {n for n, p in model.named_parameters() if p.grad is not None})
            bad += [f"{n}: no gradient (transformers has one)" for n in missing]
            if not count:
                raise AssertionError("no gradient reached any parameter")
        if bad:
            raise AssertionError(f"{len(bad)} gradients differ from transformers' (> {GRAD_RTOL:.0e}): "
                                 + "; ".join(bad[:3]))

    def steps():
        dtype = steps_dtype
        if dtype == torch.float32:  # the loaded model (a large checkpoint: no second copy on any rank)
            model = state["model"]
            model.zero_grad(set_to_none=True)
        else:
            model = loaded(dtype)
        eager_experts(getattr(model, "hf_model", model))
        with fp64_throughout():
            losses = train_losses(model, lambda m: _run(m, ids, labels=_token_ids(ids)).loss)
        del model
        if rank == 0:
            got, want = torch.tensor(losses, dtype=torch.float64), torch.tensor(ref["losses"], dtype=torch.float64)
            if not torch.allclose(got, want, rtol=LOSS_RTOL[ref["loss_dtype"]], atol=0):
                raise AssertionError(f"losses of {STEPS} AdamW steps in {dtype} (logits {ref['loss_dtype']}) {[f'{x:.10f}' for x in got.tolist()]}"
                                     f" != transformers' on one process {[f'{x:.10f}' for x in want.tolist()]}")

    def save():
        model = state["model"]
        torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS).step()  # the backward's gradients: weights not loaded
        model.save_pretrained(saved)
        trained = gather_parameters(model, [n for n, _ in model.named_parameters(remove_duplicate=False)])
        if rank == 0:
            hf_auto = getattr(transformers, auto)
            reloaded = hf_auto.from_pretrained(saved, dtype=torch.float32).state_dict()
            # what transformers' own save_pretrained of the same weights reloads as (its reload may change a tensor:
            # youtu's zeroes its padding row)
            own = ref["model"]
            own.load_state_dict(trained, strict=False)
            own.save_pretrained(f"{saved}-transformers")
            want = hf_auto.from_pretrained(f"{saved}-transformers", dtype=torch.float32).state_dict()
            bad = [k for k, v in want.items() if k not in reloaded or not torch.equal(reloaded[k], v)]
            if bad or set(reloaded) != set(want):
                raise AssertionError(f"{len(bad)} of {len(want)} tensors differ between transformers' reload "
                                     f"of tptrain's save_pretrained and of its own (same weights), e.g. "
                                     f"{(bad or sorted(set(reloaded) ^ set(want)))[0]!r}")

    def plan():
        from tptrain.diagnostics.plan_report import plan_report
        from tptrain.models import AutoConfig

        if rank != 0:
            return
        model = state["model"]
        report = plan_report(AutoConfig.from_pretrained(directory, backend="transformers"), tp_size, dtype=torch.float32,
                             expert_parallel=expert_parallel)
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        if report.problems:
            raise AssertionError(f"`tptrain plan` reports problems: {report.problems[0]}")
        if report.bytes_per_rank != held:
            raise AssertionError(f"`tptrain plan` says {report.bytes_per_rank} parameter bytes per rank, a loaded "
                                 f"rank holds {held}")
        if tp_size > 1 and model.parallel.tp and "split" not in report.text:
            raise AssertionError("`tptrain plan` lists no split parameter")

    for name, fn in zip(STAGES if causal else STAGES[:-1], (load, forward, backward, steps, save, plan)):
        out[name] = _stage(name, fn, out)
    if peer:
        out["peer"] = _peer(directory, ids, ref, tp_size, auto)
    state.clear()
    return out


def run_layout_stages(directory: Path, ids: torch.Tensor, ref: dict | None, *, tp: int, cp: int, pp: int,
                      steps_dtype: torch.dtype) -> dict:
    """A layout with context or pipeline parallelism ({stage: outcome} of LAYOUT_STAGES, and "error"): load (tptrain's
    from_pretrained on tp x cp x pp ranks, the transformers backend, in the steps' dtype), train (tptrain's Trainer,
    3 AdamW steps on the ids as one global batch, lr / eps as the steps stage, no decay, no clipping, constant lr:
    each step's loss within the steps stage's bound of transformers' own training on one process), save (the
    Trainer's final checkpoint, written from the stages, reloaded by transformers: its loss on the ids is the 4th
    loss of transformers' own training)."""
    import tempfile

    import transformers

    from tptrain import AutoModelForCausalLM, DistributedConfig
    from tptrain.distributed import comm
    from tptrain.training.args import ParallelismConfig, TrainingArguments
    from tptrain.training.data import PackedDataset
    from tptrain.training.trainer import Trainer

    rank = torch.distributed.get_rank()
    state: dict = {}
    out: dict = {}
    tmp = comm.all_gather_object(tempfile.mkdtemp() if rank == 0 else None)[0]

    def close(values, want, what):
        got, want = torch.tensor(values, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
        if not torch.allclose(got, want, rtol=LOSS_RTOL[ref["loss_dtype"]], atol=0):
            raise AssertionError(f"{what} {[f'{x:.10f}' for x in got.tolist()]} != transformers' on one process "
                                 f"{[f'{x:.10f}' for x in want.tolist()]}")

    def load():
        state["model"] = AutoModelForCausalLM.from_pretrained(directory, dtype=steps_dtype, distributed_config=(
            DistributedConfig(tp_size=tp, cp_size=cp, pp_size=pp, backend="transformers")))
        eager_experts(state["model"].hf_model)
        _without_noise(state["model"])  # the Trainer trains in train mode; the reference trains in eval mode

    def train():
        args = TrainingArguments(output_dir=tmp, max_steps=STEPS, per_device_train_batch_size=ids.shape[0],
                                 seq_len=ids.shape[1], learning_rate=LR, adam_epsilon=EPS, weight_decay=0.0,
                                 max_grad_norm=0.0, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
                                 save_steps=10**6, parallelism_config=ParallelismConfig(
                                     pp_microbatches=ids.shape[0]) if pp > 1 else None)
        with fp64_throughout():
            state["losses"] = Trainer(state.pop("model"), args=args,
                                      train_dataset=PackedDataset(ids.reshape(-1), ids.shape[1])).train().losses
        if rank == 0:
            close(state["losses"], ref["losses"][:STEPS], f"losses of {STEPS} Trainer steps")

    def save():
        if rank != 0:
            return
        ref["trained"].save_pretrained(Path(tmp) / "transformers")  # what transformers' own reload makes of it

        def loss(directory):  # (youtu's reload zeroes its padding row: both sides the same)
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / directory, dtype=steps_dtype)
            reloaded = reloaded.to(steps_dtype).eval()  # its fp32 islands too (routers), as the reference trains them
            eager_experts(reloaded)
            with fp64_throughout(), torch.no_grad():
                return _ce(reloaded(input_ids=ids, use_cache=False).logits, ids).item()

        close([loss("final")], [loss("transformers")], "the reloaded final checkpoint's loss")

    try:
        for name, fn in zip(LAYOUT_STAGES, (load, train, save)):
            out[name] = _stage(name, fn, out)
    finally:
        state.clear()
        comm.all_gather_object(None)
        if rank == 0:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _without_noise(model) -> None:
    """Dropout off in train mode (seed_oss' residual dropout), and routers kept in eval mode (phimoe's samples its
    routes in train mode: Gumbel noise, which no other layout draws as one process does): what eval mode turns off,
    which the reference's training runs in."""
    for module in model.modules():
        if type(module).__name__.endswith("Router"):
            module.train = functools.partial(_eval_only, module)
            module.train()
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for owner in (module, getattr(module, "config", None)):
            for key, value in list(vars(owner).items()) if owner is not None else ():
                if isinstance(value, float) and "dropout" in key:
                    setattr(owner, key, 0.0)


def _eval_only(module, mode: bool = True):
    for part in module.modules():
        part.training = False
    return module


def _stage(name: str, fn, out: dict) -> str:
    """Run one stage unless one failed before; the first error on any rank is the stage's outcome on every rank."""
    from tptrain.distributed import comm

    if "error" in out:
        return "-"
    error = None
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a survey: record and go on
        error = _describe(exc)
        if os.environ.get("SURVEY_TRACEBACK"):
            traceback.print_exc()
    errors = [e for e in comm.all_gather_object(error) if e]
    if errors:
        out["error"] = f"{name}: {errors[0]}"
        return "FAIL"
    return "OK"


def _describe(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' '.join(lines[:2])[:300]}"


def _peer(directory: Path, ids, ref: dict | None, tp_size: int, auto: str = "AutoModelForCausalLM") -> str:
    """transformers' own TP (`DistributedConfig(tp_size=N)`) on the same ranks: does its forward equal transformers
    on one process? "OK", "differs (relative error ...)" or "fails: <error>"."""
    import transformers

    from tptrain.distributed import comm

    error = None
    size = checkpoint_bytes(directory)
    if size > PEER_MAX_BYTES:  # transformers' TP loading of it takes several times that on each rank
        return f"not run (a {size / 2**30:.1f} GiB checkpoint: full-size sub-models)"
    try:
        model = getattr(transformers, auto).from_pretrained(
            directory, dtype=torch.float32, distributed_config=transformers.DistributedConfig(tp_size=tp_size)).eval()
        with torch.no_grad():
            logits = _run(model, ids, use_cache=False).logits
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        if torch.distributed.get_rank() == 0 and (err := relative_error(logits, ref["logits"])) > FORWARD_RTOL:
            error = f"differs (relative error {err:.1e})"
    except Exception as exc:  # noqa: BLE001 - a survey: record and go on
        error = f"fails: {_describe(exc)}"
        if os.environ.get("SURVEY_TRACEBACK"):
            traceback.print_exc()
    errors = [e for e in comm.all_gather_object(error) if e]
    return errors[0] if errors else "OK"
