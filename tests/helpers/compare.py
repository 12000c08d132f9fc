"""A distributed model against its one-process reference: every parameter and gradient gathered over tensor
parallelism, compared with the single-device copy's (logits, losses, gradients, AdamW steps); a model's logits and
loss against transformers'; one training step of both on data-parallel batches."""
from __future__ import annotations

import torch

from tests.helpers.batches import batch
from tptrain.parallel.tensor_parallel import gather_full

TOL = dict(rtol=1e-10, atol=1e-10)  # fp64: a layout bug is an O(1) error


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every trained parameter's gradient, gathered (frozen ones, DeepSeek's e_score_correction_bias, have none)."""
    layout = model.parallel.tp
    return {n: gather_full(p.grad, layout.specs[n], layout.ctx) for n, p in model.named_parameters()
            if p.requires_grad}


def full_params(model) -> dict[str, torch.Tensor]:
    layout = model.parallel.tp
    return {n: gather_full(p.detach(), layout.specs[n], layout.ctx) for n, p in model.named_parameters()}


def assert_grads_match(model, ref, *, tol: dict = TOL, what: str = "grad") -> None:
    """Every gathered TP gradient equals the single-device one."""
    grads = full_grads(model)
    for n, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[n], p.grad, **tol, msg=lambda m: f"{what} of {n}: {m}")


def assert_params_match(model, ref, after: str) -> None:
    params = full_params(model)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(params[n], p.detach(), **TOL, msg=lambda m: f"{n} after {after}: {m}")


def assert_trains_like(model, ref, ids, labels, *, steps: int = 3, tol: dict = TOL, what: str = "tp") -> float:
    """The TP `model` equals its single-device copy `ref` on one batch: the logits, the loss of each of `steps`
    AdamW steps (lr 1e-2), every gathered gradient of the first and every parameter after the last. Returns
    max |logits - single-device logits|."""
    with torch.no_grad():
        logits, ref_logits = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(logits, ref_logits, **tol, msg=lambda m: f"{what} logits: {m}")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        ref_loss, loss = ref(ids, labels=labels).loss, model(ids, labels=labels).loss
        torch.testing.assert_close(loss, ref_loss, **tol, msg=lambda m: f"{what} loss, step {step}: {m}")
        ref_loss.backward()
        loss.backward()
        if step == 0:
            assert_grads_match(model, ref, tol=tol, what=f"{what} grad")
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    assert_params_match(model, ref, f"{what}: {steps} AdamW steps")
    return (logits - ref_logits).abs().max().item()


def check_against_hf(model, expected: dict[str, torch.Tensor], what: str, tol: dict) -> float:
    """Asserts logits and loss on `batch()` equal transformers' (`expected`: hf_reference); returns
    max |logits - transformers|."""
    ids, labels = batch()
    with torch.no_grad():
        logits, loss = model(ids).logits, model(ids, labels=labels).loss
    torch.testing.assert_close(logits, expected["logits"], **tol, msg=lambda m: f"{what} logits: {m}")
    torch.testing.assert_close(loss, expected["loss"], **tol, msg=lambda m: f"{what} loss: {m}")
    return (logits - expected["logits"]).abs().max().item()


def step_both(ref, model, batches, dp=None, summed=lambda name: True):
    """One training step's forward and backward of the one-process `ref` and the distributed `model` on
    `dp_batches`' `batches`: (the loss summed over `dp`, ref's loss); over `dp` the gradients of the parameters
    named by `summed` are summed as data parallelism sums them."""
    import torch.distributed as dist
    ids, labels, all_ids, all_labels, count = batches
    ref_loss = ref(all_ids, labels=all_labels, num_items_in_batch=count).loss
    loss = model(ids, labels=labels, num_items_in_batch=count).loss
    ref_loss.backward(), loss.backward()
    if dp is not None:
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=dp.get_group())
        for n, p in model.named_parameters():
            if p.grad is not None and summed(n):
                dist.all_reduce(p.grad, group=dp.get_group())
    return loss, ref_loss


# ------------------------------------------------------------------ the families against transformers

# transformers normalises (RMSNorm) and routes (softmax) in fp32 even in an fp64 model; tptrain routes in fp32 too.
MOE_HF_TOL = dict(rtol=1e-5, atol=1e-5)
# transformers' Olmo2RMSNorm normalises in fp32 even in an fp64 model (tptrain: in fp64), ~1e-6 apart.
OLMO2_HF_TOL = dict(rtol=1e-6, atol=1e-6)


def check_against_olmo_hf(model, expected, what: str) -> float:
    """check_against_hf at OLMo's tolerance (test_family_olmo2.py, test_family_olmo3.py)."""
    return check_against_hf(model, expected, what, OLMO2_HF_TOL)


def trains_like_on_batch(model, ref, *, steps: int = 3) -> float:
    """Logits, gradients of every parameter and 3 AdamW steps of the TP `model` equal the single-device `ref` on
    `batch(seed=2)`; returns max |logits - single-device logits|."""
    return assert_trains_like(model, ref, *batch(seed=2), steps=steps, tol=TOL)


def hf_grad(hf_grads: dict, name: str, inner: int) -> torch.Tensor:
    """transformers' gradient for tptrain parameter `name` (its experts are fused gate_up_proj, down_proj)."""
    if name.endswith("experts.gate_proj") or name.endswith("experts.up_proj"):
        fused = hf_grads[name.rpartition(".")[0] + ".gate_up_proj"]
        return fused[:, :inner] if name.endswith("gate_proj") else fused[:, inner:]
    return hf_grads[name]


def route_to_first_rank(model, experts_on_rank0: int) -> None:
    """Every token's experts -> experts held by rank 0 (ids modulo its count): the other ranks' experts get none."""
    for block in model.modules():
        if hasattr(block, "route"):
            route = block.route

            def first_only(x, route=route):
                logits, weights, ids = route(x)
                return logits, weights, ids % experts_on_rank0

            block.route = first_only
