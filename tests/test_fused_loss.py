"""The fused linear cross-entropy (issue 24): the loss and its gradients computed together in forward, chunk by
chunk; backward only scales them. Against the unfused path (whole logits, then the (vocab-parallel) cross-entropy)
in fp64: the bare function, and whole models at tp 1, 2 and 4 with and without sequence parallelism, with
soft-capped (Gemma 2) and divided (Granite) logits, ignored labels, `num_items_in_batch`, a frozen head and an
incoming gradient other than 1; two all-reduces per chunk; and no matmul over the vocabulary in backward.

    .venv/bin/python -m pytest tests/test_fused_loss.py -q
"""
from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.batches import labelled_batch
from tests.helpers.ranks import run_distributed
from tptrain import DistributedConfig, losses
from tptrain.diagnostics.accounting import comm_report
from tptrain.distributed.comm import CommTracker
from tptrain.losses import IGNORE_INDEX, chunk_bounds, fused_linear_cross_entropy
from tptrain.models import AutoConfig, AutoModelForCausalLM
from tptrain.models.layers import tanh_softcap as softcap

F64 = torch.float64
EXACT = dict(rtol=1e-12, atol=1e-12)
# Sizes with no dimension in common with the vocabulary or its shards (120, 60, 30), so a matmul over the
# vocabulary is recognised by its shapes.
VOCAB, HIDDEN, B, S = 120, 32, 2, 12
_batch = partial(labelled_batch, VOCAB, 3, B, S, ignored=((0, slice(None, 4)), (1, 7)))  # 5 labels ignored
CHUNK = 5  # tokens a chunk in the model tests: 24 tokens in 5 chunks, the last short
CONFIGS = {  # plain; logits divided (Granite) with tied embeddings; soft-capped logits (Gemma 2)
    "qwen3": {},
    "granite": dict(logits_scaling=4.0, tie_word_embeddings=True),
    "gemma2": dict(final_logit_softcapping=3.0, attn_logit_softcapping=None, query_pre_attn_scalar=8),
}
TRANSFORMS = {"none": lambda z: z, "divisor": lambda z: z / 4.0, "softcap": lambda z: softcap(z, 3.0)}
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.matmul.default, torch.ops.aten.linear.default}


def _reference(h, weight, target, denom, transform):
    """The unfused loss: the whole logits, transformed, in fp32 or wider, then the summed cross-entropy over
    `denom`."""
    logits = transform(F.linear(h, weight))
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum") / denom


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("chunk", [None, 3, 7])  # one chunk; 3 tokens a chunk (4, the last short); 7: 5 + 5
@pytest.mark.parametrize("denom", ["count", 7, "tensor"])
@pytest.mark.parametrize("frozen", ["none", "weight", "h"])
def test_function_matches_unfused(transform, chunk, denom, frozen):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(10, 8, generator=g, dtype=F64) * 2
    weight = torch.randn(13, 8, generator=g, dtype=F64)
    target = torch.randint(0, 13, (10,), generator=g)
    target[[1, 4, 5]] = IGNORE_INDEX
    denom = {"count": (target != IGNORE_INDEX).sum(), "tensor": torch.tensor(7)}.get(denom, denom)
    fused = [t.clone().requires_grad_(frozen != name) for t, name in ((h, "h"), (weight, "weight"))]
    whole = [t.clone().requires_grad_(frozen != name) for t, name in ((h, "h"), (weight, "weight"))]
    loss = fused_linear_cross_entropy(*fused, target, denom, transform=TRANSFORMS[transform], chunk=chunk)
    ref = _reference(*whole, target, denom, TRANSFORMS[transform])
    torch.testing.assert_close(loss, ref, **EXACT)
    (loss * 0.5).backward(), (ref * 0.5).backward()
    for mine, theirs, name in zip(fused, whole, ("h", "weight")):
        assert (mine.grad is None) == (frozen == name) == (theirs.grad is None), name
        if mine.grad is not None:
            torch.testing.assert_close(mine.grad, theirs.grad, **EXACT, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("frozen", ["none", "weight", "h"])
def test_function_keeps_only_the_gradients_it_needs(transform, frozen):
    """Kept for backward: grad_h (tokens, hidden) and grad_w (vocab, hidden), each only where wanted (a frozen head
    computes no weight gradient at all), handed over once; no saved tensor, the transform's own saves included."""
    h = torch.randn(10, 8, dtype=F64, requires_grad=frozen != "h")
    weight = torch.randn(13, 8, dtype=F64, requires_grad=frozen != "weight")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        loss = fused_linear_cross_entropy(h, weight, torch.randint(0, 13, (10,)), 10, transform=TRANSFORMS[transform],
                                          chunk=3)
    assert saved == [], saved
    kept = [None if g is None else tuple(g.shape) for g in loss.grad_fn.grads]
    assert kept == [None if name == frozen else shape for shape, name in (((10, 8), "h"), ((13, 8), "weight"))]
    loss.backward(retain_graph=True)
    assert loss.grad_fn.grads is None  # released at once, not with the graph
    with pytest.raises(RuntimeError, match="ran twice"):
        loss.backward()


def test_function_without_grad_and_all_ignored():
    """Under no_grad nothing is computed for backward; every label ignored: nan loss (0 / 0, as unfused) and
    zero gradients."""
    h, weight = torch.randn(6, 4, dtype=F64, requires_grad=True), torch.randn(9, 4, dtype=F64, requires_grad=True)
    target = torch.randint(0, 9, (6,))
    with torch.no_grad():
        loss = fused_linear_cross_entropy(h, weight, target, 6, transform=TRANSFORMS["none"], chunk=4)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, _reference(h, weight, target, 6, TRANSFORMS["none"]).detach(), **EXACT)
    ignored = torch.full((6,), IGNORE_INDEX)
    loss = fused_linear_cross_entropy(h, weight, ignored, (ignored != IGNORE_INDEX).sum(), transform=lambda z: z)
    assert loss.isnan()
    loss.backward()
    assert not h.grad.any() and not weight.grad.any()


@pytest.mark.parametrize("tokens, chunk, sizes", [(512, 441, [256, 256]), (10, 3, [3, 3, 3, 1]), (10, 7, [5, 5]),
                                                (10, 10, [10]), (10, 64, [10]), (0, 5, [])])
def test_chunks_are_as_few_as_allowed_and_of_equal_size(tokens, chunk, sizes):
    bounds = chunk_bounds(tokens, chunk)
    assert [stop - start for start, stop in bounds] == sizes
    assert [start for start, _ in bounds] == [0, *(stop for _, stop in bounds)][:len(bounds)]  # contiguous


def test_function_without_tokens_gives_zero_gradients():
    """No token at all: no chunk writes the weight gradient, which is then zeros (not left uninitialised)."""
    h, weight = torch.randn(0, 4, dtype=F64, requires_grad=True), torch.randn(9, 4, dtype=F64, requires_grad=True)
    loss = fused_linear_cross_entropy(h, weight, torch.zeros(0, dtype=torch.long), 3, transform=lambda z: z)
    loss.backward()
    assert loss.item() == 0.0 and weight.grad.shape == (9, 4) and not weight.grad.any() and h.grad.shape == (0, 4)


@pytest.mark.parametrize("transform", ["none", "softcap"])
def test_function_under_autocast_is_the_unfused_autocast(transform):
    """Under bf16 autocast the head's matmuls run in bf16, as autograd runs the unfused head's (in fp32 instead,
    the loss and input gradient would be ~1e-3 off); the gradients come back in the fp32 of `h` and the weight.
    The weight gradient is summed over 4 chunks in bf16 instead of made by one matmul: equal to bf16 rounding."""
    g = torch.Generator().manual_seed(0)
    h, weight = torch.randn(10, 16, generator=g), torch.randn(13, 16, generator=g)
    target = torch.randint(0, 13, (10,), generator=g)
    fused, whole = [[t.clone().requires_grad_() for t in (h, weight)] for _ in range(2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(*fused, target, 10, transform=TRANSFORMS[transform], chunk=3)
        ref = _reference(*whole, target, 10, TRANSFORMS[transform])
    assert loss.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    (loss * 0.5).backward(), (ref * 0.5).backward()
    assert fused[0].grad.dtype == fused[1].grad.dtype == torch.float32
    torch.testing.assert_close(fused[0].grad, whole[0].grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[1].grad, whole[1].grad, rtol=2e-2, atol=4e-3)


class _VocabMatmuls(TorchDispatchMode):
    """Records every matmul with an operand that has a dim of `vocab` (the head's local rows)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.seen = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS and any(isinstance(a, torch.Tensor) and self.vocab in a.shape for a in args):
            self.seen.append((str(func), [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


def _model(model_type: str) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=40,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  **CONFIGS[model_type])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=F64)


# name: (num_items_in_batch, head frozen, factor on the loss before backward)
CASES = {"token mean": (None, False, 1.0), "num_items": (31, False, 1.0),
         "num_items tensor, loss x 0.5": (torch.tensor(29), False, 0.5), "frozen head": (None, True, 1.0)}


def _compare_case(fused_model, whole_model, case: str, what: str) -> None:
    """Loss and every parameter's gradient of the fused path equal the whole-logits path (same layout)."""
    items, frozen, factor = CASES[case]
    for m in (fused_model, whole_model):
        m.lm_head.weight.requires_grad_(not frozen)
    ids, labels = _batch()
    fused = fused_model(ids, labels=labels, num_items_in_batch=items)
    whole = whole_model(ids, labels=labels, num_items_in_batch=items, return_logits=True)
    assert fused.logits is None and whole.logits is not None
    torch.testing.assert_close(fused.loss, whole.loss, **EXACT, msg=lambda m: f"{what} {case} loss: {m}")
    (fused.loss * factor).backward(), (whole.loss * factor).backward()
    theirs = dict(whole_model.named_parameters())
    for name, p in fused_model.named_parameters():
        assert (p.grad is None) == (theirs[name].grad is None) == (frozen and p is fused_model.lm_head.weight), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, theirs[name].grad, **EXACT, msg=lambda m: f"{what} {case} {name}: {m}")
    for m in (fused_model, whole_model):
        m.lm_head.weight.requires_grad_(True)
        m.zero_grad(set_to_none=True)


def _assert_no_vocab_matmul_in_backward(model, local_vocab: int, what: str) -> None:
    """The fused path's backward does no matmul over the vocabulary; its forward and the unfused path's backward
    do (so the check can fail)."""
    ids, labels = _batch()
    with _VocabMatmuls(local_vocab) as forward:
        loss = model(ids, labels=labels).loss
    with _VocabMatmuls(local_vocab) as backward:
        loss.backward()
    assert forward.seen and not backward.seen, (what, backward.seen)
    loss = model(ids, labels=labels, return_logits=True).loss
    with _VocabMatmuls(local_vocab) as unfused:
        loss.backward()
    assert unfused.seen, what
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_one_device_fused_equals_unfused(model_type, monkeypatch):
    monkeypatch.setattr(losses, "CHUNK_FLOATS", CHUNK * VOCAB)
    model = _model(model_type)
    for case in CASES:
        _compare_case(model, copy.deepcopy(model), case, f"{model_type} 1 device")
    _assert_no_vocab_matmul_in_backward(model, VOCAB, model_type)


def _loss_all_reduces(t: CommTracker) -> list[tuple[int, ...]]:
    return [r.shape for r in t.records if r.phase == "forward" and r.op == "all_reduce" and len(r.shape) == 1]


def _tp_worker(tp: int) -> None:
    losses.CHUNK_FLOATS = CHUNK * VOCAB // tp  # CHUNK tokens a chunk of this rank's vocabulary
    ids, labels = _batch()
    chunks = [min(CHUNK, B * S - start) for start in range(0, B * S, CHUNK)]
    for model_type in CONFIGS:
        ref = _model(model_type)
        for sp in (False, True):
            config = DistributedConfig(tp_size=tp, enable_sequence_parallel=sp)
            what = f"{model_type} tp={tp}{' sp' if sp else ''}"
            fused, whole = copy.deepcopy(ref).parallelize(config), copy.deepcopy(ref).parallelize(config)
            for case in CASES:
                _compare_case(fused, whole, case, what)
            _assert_no_vocab_matmul_in_backward(fused, VOCAB // tp, what)
            # Per chunk: the max (chunk,), then [target logit, sum-exp] (2 * chunk,); whole logits are one chunk.
            with CommTracker() as t:
                fused(ids, labels=labels).loss.backward()
                fused(ids, labels=labels, return_logits=True).loss.backward()
            assert _loss_all_reduces(t) == [s for c in chunks + [B * S] for s in ((c,), (2 * c,))], what
            for unfused in (False, True):
                report = comm_report(fused, ids, labels, return_logits=unfused)
                assert report.matches_minimum and report.full_logit_collectives == 0, (what, report.table())
            fused.zero_grad(set_to_none=True)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_fused_equals_unfused(tp):
    run_distributed(_tp_worker, tp, tp)
