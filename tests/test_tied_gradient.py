"""The tied embedding's gradient added into the head's (layers.HeadGradient, issue 36): with tie_word_embeddings the
embedding's backward adds its rows into the gradient the fused head + loss made, instead of making a dense
(vocab, hidden) gradient that autograd then sums into it. The same floats as the plain path (fp32, bit for bit,
a padding id in the batch), no vocab-sized tensor made in backward, a lower peak, and either backward order.

    .venv/bin/python -m pytest tests/test_tied_gradient.py -q
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.batches import labelled_batch
from tptrain.diagnostics.tensor_meter import LiveTensorBytes
from tptrain.models import AutoConfig, AutoModelForCausalLM
from tptrain.models.layers import Embedding, HeadGradient

VOCAB, HIDDEN, PAD = 120, 32, 7


def _model(dtype=torch.float32, **extra):
    shape = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=40, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, pad_token_id=PAD)
    config = AutoConfig.for_model("qwen3", **{**shape, **extra})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).train()


def _batch():
    ids, _ = labelled_batch(VOCAB, 3, 2, 12, ignored=())
    ids[0, 2] = ids[1, 5] = ids[1, 6] = PAD  # the pad row gets no gradient from the embedding
    ids[0, 3] = ids[1, 9] = ids[0, 8]  # an id seen three times
    return ids, ids.clone()


def _grads(model, factor=1.0):
    ids, labels = _batch()
    (model(ids, labels=labels).loss * factor).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_same_floats_as_the_dense_sum(factor, monkeypatch):
    model = _model()
    plain = copy.deepcopy(model)
    monkeypatch.setattr(plain, "_head_gradient_meets_embedding", lambda: False)
    mine, theirs = _grads(model, factor), _grads(plain, factor)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name
    weight = model.model.embed_tokens.weight
    assert model.lm_head.weight is weight and weight.grad[PAD].any()  # the head's gradient at the pad row stays


class _Recorder(TorchDispatchMode):
    """The ops run, and which of them made a tensor of `rows` rows in new memory (not a view, not in place)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows, self.ops, self.made = rows, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(func)
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        if isinstance(out, torch.Tensor) and out.dim() and out.shape[0] == self.rows \
                and out.untyped_storage().data_ptr() not in inputs:
            self.made.append(func)
        return out


def test_backward_makes_no_vocab_sized_tensor(monkeypatch):
    """Backward adds rows into the head's gradient in place; the plain path makes the dense embedding gradient."""
    for meets in (True, False):
        model = _model()
        monkeypatch.setattr(model, "_head_gradient_meets_embedding", lambda m=meets: m)
        ids, labels = _batch()
        loss = model(ids, labels=labels).loss
        with _Recorder(VOCAB) as seen:
            loss.backward()
        dense = torch.ops.aten.embedding_dense_backward.default
        assert (dense in seen.ops, bool(seen.made)) == (not meets, not meets), (meets, seen.made)


def test_peak_is_one_vocab_sized_gradient_lower():
    """The step's peak tensor bytes drop by at least the dense embedding gradient (vocab x hidden): with a
    vocabulary this large the peak is the end of backward, where the plain path holds both gradients."""
    peaks = []
    for meets in (True, False):
        model = _model(vocab_size=4096)
        model._head_gradient_meets_embedding = lambda m=meets: m
        ids = torch.randint(0, 4096, (2, 12), generator=torch.Generator().manual_seed(3))
        with LiveTensorBytes(existing=list(model.parameters())) as meter:
            model(ids, labels=ids).loss.backward()
        peaks.append(meter.peak)
    assert peaks[1] - peaks[0] >= 4096 * HIDDEN * 4, peaks  # (plus the plain path's bookkeeping)


def test_embedding_backward_first_falls_back_to_the_sum():
    """Whatever order autograd runs the two backwards in, the weight's gradient is their sum: here the embedding's
    comes first (made after the head's view, it runs first), finds nothing parked and makes the dense gradient; the
    head's gradient then goes on to the weight."""
    embedding = Embedding(VOCAB, HIDDEN, padding_idx=PAD, dtype=torch.float64)
    ids, _ = _batch()
    meeting = HeadGradient()
    head = meeting.head_weight(embedding.weight)
    embedding.head_gradient = meeting
    rows = embedding(ids)
    embedding.head_gradient = None
    coef = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
    ((head * coef).sum() + (rows ** 2).sum()).backward()
    assert meeting.embedding_done and meeting.grad is None
    weight = embedding.weight.detach().clone().requires_grad_()
    ((weight * coef).sum() + (torch.nn.functional.embedding(ids, weight, PAD) ** 2).sum()).backward()
    torch.testing.assert_close(embedding.weight.grad, weight.grad, rtol=1e-12, atol=1e-12)


def test_only_when_the_head_is_the_embedding():
    """Untied, frozen, evaluation or no grad: the plain path (the check the forward reads)."""
    assert _model()._head_gradient_meets_embedding()
    assert not _model(tie_word_embeddings=False)._head_gradient_meets_embedding()
    frozen = _model()
    frozen.model.embed_tokens.weight.requires_grad_(False)
    assert not frozen._head_gradient_meets_embedding()
    with torch.no_grad():
        assert not _model()._head_gradient_meets_embedding()
