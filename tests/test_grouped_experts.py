"""The experts' grouped matmul: torch's grouped GEMM (`F.grouped_mm`) for fp32 and bf16 (autocast too), the per-expert
loop for fp64 and under an adapter's per-expert projection; both the same forward and backward, an expert given no
row a zero gradient; and every TP / expert-parallel layout of an fp32 model through the kernel, equal to one device.

    .venv/bin/python -m pytest tests/test_grouped_experts.py -q
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.compare import full_grads
from tests.helpers.ranks import run_distributed
from tests.helpers.trainer import tiny_moe
from tptrain import DistributedConfig
from tptrain.models.moe import Experts

COUNTS = [0, 9, 0, 11]  # the first and third experts get no row
TOLS = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}

needs_grouped_mm = pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch < 2.10 has no F.grouped_mm")


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    """Every call of F.grouped_mm (its operands' dtypes), the kernel still run."""
    calls, kernel = [], F.grouped_mm

    def spy(a, b, **kwargs):
        calls.append((a.dtype, b.dtype))
        return kernel(a, b, **kwargs)

    monkeypatch.setattr(F, "grouped_mm", spy)
    return calls


def experts(dtype: torch.dtype) -> Experts:
    torch.manual_seed(0)
    module = Experts(4, 32, 24, top_k=2).to(dtype)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return module


def _run(module: Experts, how: str, rows: torch.Tensor, grad: torch.Tensor):
    """(output, rows' gradient, the weights' gradients) of `module.<how>(rows, COUNTS)` backpropagating `grad`."""
    module.zero_grad(set_to_none=True)
    rows = rows.detach().clone().requires_grad_()
    out = getattr(module, how)(rows, COUNTS)
    out.backward(grad)
    return out.detach(), rows.grad, {n: p.grad for n, p in module.named_parameters()}


def _assert_same(got, want, tol: dict) -> None:
    torch.testing.assert_close(got[0], want[0], **tol, msg=lambda m: f"output: {m}")
    torch.testing.assert_close(got[1], want[1], **tol, msg=lambda m: f"rows' gradient: {m}")
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, **tol, msg=lambda m: f"gradient of {name}: {m}")


@needs_grouped_mm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_the_loop_and_empty_experts_get_zero_gradients(dtype, kernel_calls):
    module, g = experts(dtype), torch.Generator().manual_seed(1)
    rows = torch.randn(sum(COUNTS), 32, generator=g).to(dtype)
    grad = torch.randn(sum(COUNTS), 32, generator=g).to(dtype)
    want = _run(module, "loop", rows, grad)
    assert kernel_calls == []
    got = _run(module, "grouped", rows, grad)
    assert kernel_calls == [(dtype, dtype)] * 3, kernel_calls  # gate, up, down: the kernel, not the loop
    _assert_same(got, want, TOLS[dtype])
    for name, weight_grad in got[2].items():  # every weight has a gradient, zero where no row went
        assert weight_grad is not None and weight_grad.shape == module.get_parameter(name).shape
        assert weight_grad[0].count_nonzero() == 0 and weight_grad[2].count_nonzero() == 0, name
        assert weight_grad[1].count_nonzero() > 0 and weight_grad[3].count_nonzero() > 0, name


@needs_grouped_mm
def test_grouped_mm_under_bf16_autocast_computes_as_the_loop_does(kernel_calls):
    module, g = experts(torch.float32), torch.Generator().manual_seed(2)
    rows, grad = torch.randn(sum(COUNTS), 32, generator=g), torch.randn(sum(COUNTS), 32, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _run(module, "loop", rows, grad)
        got = _run(module, "grouped", rows, grad)
    assert kernel_calls == [(torch.bfloat16, torch.bfloat16)] * 3, kernel_calls
    assert got[0].dtype == want[0].dtype == torch.bfloat16
    _assert_same(got, want, TOLS[torch.bfloat16])


def test_fp64_and_an_adapters_projection_take_the_loop(kernel_calls):
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(sum(COUNTS), 32, generator=g, dtype=torch.float64)
    grad = torch.randn(sum(COUNTS), 32, generator=g, dtype=torch.float64)
    module = experts(torch.float64)
    _assert_same(_run(module, "grouped", rows, grad), _run(module, "loop", rows, grad), dict(rtol=0, atol=0))

    adapted = experts(torch.float32)
    plain = _run(adapted, "grouped", rows.float(), grad.float())[0]
    kernel_calls.clear()
    adapted.project = lambda name, i, x, weight: Experts.project(adapted, name, i, x, weight) + (name == "down_proj")
    out = _run(adapted, "grouped", rows.float(), grad.float())[0]
    assert kernel_calls == []  # the per-expert term (LoRA's, peft/lora_experts.py) exists only in the loop
    torch.testing.assert_close(out, plain + 1, **TOLS[torch.float32])


def _layouts_worker() -> None:
    """fp32 experts over 2 ranks through the kernel: expert TP (summed partials) and expert parallelism by all-to-all,
    their loss and gathered gradients one device's; the ep axis at tp 1 (each rank feeding the same batch here), its
    loss one device's."""
    ref = tiny_moe(torch.float32)  # top-2 of 4 experts
    layouts = {"expert_tensor_parallel": dict(tp_size=2), "expert_parallel_all_to_all": dict(tp_size=2, tp_plan={
        "layers.*.mlp.experts": "expert_parallel_all_to_all"}), "ep axis": dict(tp_size=1, ep_size=2)}
    models = {name: copy.deepcopy(ref).parallelize(DistributedConfig(**kw)) for name, kw in layouts.items()}
    ids = torch.randint(0, ref.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    want = ref(ids, labels=ids).loss
    want.backward()
    calls, kernel = [], F.grouped_mm
    F.grouped_mm = lambda a, b, **k: calls.append(a.dtype) or kernel(a, b, **k)
    try:
        losses = {}
        for name, model in models.items():
            losses[name] = model(ids, labels=ids).loss
            losses[name].backward()
            assert calls and set(calls) == {torch.float32}, (name, calls)
            calls.clear()
    finally:
        F.grouped_mm = kernel
    for name, loss in losses.items():
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"loss at {name}: {m}")
    for style in ("expert_tensor_parallel", "expert_parallel_all_to_all"):
        assert models[style].tp_plan["model.layers.0.mlp.experts"] == style
        grads = full_grads(models[style])
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{style} {name}: {m}")


@pytest.mark.distributed
@needs_grouped_mm
def test_every_expert_layout_runs_the_kernel_and_matches_one_device():
    run_distributed(_layouts_worker, 2, timeout=600)
