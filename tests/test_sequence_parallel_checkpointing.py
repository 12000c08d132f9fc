"""Activation checkpointing on a TP model, with and without sequence parallelism, against one device (fp64).

Checkpointing re-runs each decoder layer in backward, so the TP/SP collectives inside a layer run again
there, and under SP the recomputed layer gathers its sequence shard once more. Both must leave the loss,
every gradient and the optimizer steps equal to the plain single-device model.
"""
from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.batches import labelled_batch as batch
from tests.helpers.compare import TOL, assert_grads_match, assert_params_match
from tests.helpers.configs import make_config
from tests.helpers.ranks import run_distributed
from tptrain import DistributedConfig
from tptrain.models import AutoModelForCausalLM
from tptrain.diagnostics.accounting import SavedTensorMeter
from tptrain.distributed.comm import CommTracker

pytestmark = pytest.mark.distributed

TP = 2


def _check_checkpointed(ref, model, ids, labels, *, sp: bool) -> None:
    """Loss, gathered gradients and 2 AdamW steps of the checkpointed TP model equal the plain reference."""
    what = f"tp {TP}, sequence_parallel={sp}, checkpointing"
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        ref_loss = ref(ids, labels=labels).loss
        with CommTracker() as t:
            loss = model(ids, labels=labels).loss
            torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"loss ({what}): {m}")
            ref_loss.backward()
            loss.backward()
        if step == 0:
            _check_recomputed(t, layers=len(ref.model.layers), sp=sp)
            assert_grads_match(model, ref, what=f"grad ({what})")
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    assert_params_match(model, ref, f"2 AdamW steps ({what})")


def _check_recomputed(t: CommTracker, *, layers: int, sp: bool) -> None:
    """The layers really were recomputed: their row-parallel sums (all-reduce, or reduce-scatter under SP)
    ran again inside backward. Without checkpointing backward has exactly one per TP boundary (2 per layer
    + the head). torch's non-reentrant checkpoint stops recomputing once the last saved tensor is back, so
    a layer's final sum (down_proj: nothing after it saves a tensor) may be skipped: 1 or 2 per layer."""
    op = "reduce_scatter" if sp else "all_reduce"
    extra = t.counts("backward")[op] - (2 * layers + 1)
    assert layers <= extra <= 2 * layers, (op, dict(t.counts("forward")), dict(t.counts("backward")))


def _saved_bytes(model, ids, labels) -> int:
    with SavedTensorMeter(model.parameters()) as meter:
        loss = model(ids, labels=labels).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return meter.bytes


def _worker() -> None:
    torch.manual_seed(0)
    config = make_config("qwen3")
    ids, labels = batch(config.vocab_size, s=32)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    ref = copy.deepcopy(base).train()  # the reference stays un-checkpointed: recomputation must not change math

    for sp in (False, True):
        model = copy.deepcopy(base).parallelize(DistributedConfig(tp_size=TP, enable_sequence_parallel=sp))
        model.gradient_checkpointing_enable()
        model.train()
        _check_checkpointed(copy.deepcopy(ref), model, ids, labels, sp=sp)

    # Saved-activation bound of SP under checkpointing: what each rank keeps between forward and backward
    # is at most 1/tp (+10%) of the same checkpointed model on one device. The checkpointed layers keep only
    # their input, which under SP is the sequence shard; outside them the SP saver keeps shards too.
    single = copy.deepcopy(base).train()
    single.gradient_checkpointing_enable()
    sp_model = copy.deepcopy(base).parallelize(DistributedConfig(tp_size=TP, enable_sequence_parallel=True))
    sp_model.gradient_checkpointing_enable()
    sp_model.train()
    single_bytes, sp_bytes = _saved_bytes(single, ids, labels), _saved_bytes(sp_model, ids, labels)
    assert sp_bytes <= 1.1 * single_bytes / TP, (sp_bytes, single_bytes, TP)
    # The recompute in backward gathers again outside the model's forward; the SP saver must not keep
    # those shards (nothing packs them) alive past the backward: 2 per layer, until the next forward.
    saver = sp_model.parallel.tp.ctx.on_gather.__self__
    assert not saver._gathered, f"{len(saver._gathered)} recomputed SP shards kept after backward"


def test_checkpointing_with_tp_and_sequence_parallel_matches_single_device():
    run_distributed(_worker, TP)
