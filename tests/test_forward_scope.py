"""The one parallel state and the one forward scope (tptrain/distributed/state.py): the axes' begin / end pairs run in
STEPS order around every path through a model, end in reverse, and a failed begin leaves nothing open."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tptrain.distributed.state import Batch, ForwardScope, ParallelState, state_of
from tptrain.layout import ParallelDims
from tptrain.parallel.parallelize import _run_scope_around_forward


class Recorder:
    """An axis that records its calls and optionally rewrites the batch or the output, or fails in begin."""

    def __init__(self, name, log, *, ids_offset=0, fail=False):
        self.name, self.log, self.ids_offset, self.fail = name, log, ids_offset, fail

    def begin(self, batch):
        self.log.append(("begin", self.name, batch.where))
        if self.fail:
            raise ValueError(f"{self.name} refuses")
        if self.ids_offset and batch.input_ids is not None:
            return batch.replace(input_ids=batch.input_ids + self.ids_offset)
        return batch

    def end(self, batch, output):
        self.log.append(("end", self.name, output is None))
        return output


def test_begin_in_order_end_in_reverse_and_changes_reach_the_forward():
    log, scope = [], ForwardScope()
    scope.add(Recorder("tp", log, ids_offset=1))
    scope.add(Recorder("cp", log, ids_offset=10))
    seen = []
    out = scope.run(Batch("model", input_ids=torch.zeros(1, 2, dtype=torch.long)),
                    lambda b: seen.append(b.input_ids) or "out")
    assert out == "out" and seen[0].tolist() == [[11, 11]]
    assert log == [("begin", "tp", "model"), ("begin", "cp", "model"), ("end", "cp", False), ("end", "tp", False)]


def test_a_failed_begin_ends_the_axes_begun_and_leaves_nothing_open():
    log, scope = [], ForwardScope()
    scope.add(Recorder("tp", log))
    scope.add(Recorder("sp", log, fail=True))
    scope.add(Recorder("cp", log))
    with pytest.raises(ValueError, match="sp refuses"):
        scope.run(Batch("model"), lambda b: "never")
    assert log == [("begin", "tp", "model"), ("begin", "sp", "model"), ("end", "tp", True)]
    assert scope._open == []


def test_a_failed_forward_ends_every_axis_without_output():
    log, scope = [], ForwardScope()
    scope.add(Recorder("tp", log))

    def broken(batch):
        raise RuntimeError("forward failed")

    with pytest.raises(RuntimeError, match="forward failed"):
        scope.run(Batch("stage"), broken)
    assert log == [("begin", "tp", "stage"), ("end", "tp", True)] and scope._open == []


def test_a_pipeline_step_nests_its_stages():
    log, scope = [], ForwardScope()
    scope.add(Recorder("cp", log))
    scope.run(Batch("step"), lambda b: scope.run(Batch("stage"), lambda s: None))
    assert [(kind, where) for kind, _, where in log if kind == "begin"] == [("begin", "step"), ("begin", "stage")]
    assert Batch("step").whole and not Batch("step").runs and Batch("stage").runs and not Batch("stage").whole


class Toy(nn.Module):
    def forward(self, input_ids, *, labels=None, position_ids=None, num_items_in_batch=None):
        return {"ids": input_ids, "labels": labels, "positions": position_ids}


def test_the_model_forward_runs_the_scope_through_its_hooks():
    """What an axis changes (a cp rank's tokens, this rank's positions) reaches the forward's arguments; a decode step
    (one new token per sequence, its positions given) is a batch like any other; a begin that raises leaves the hooks
    balanced for the next call."""
    log, scope = [], ForwardScope()
    axis = Recorder("cp", log, ids_offset=5)
    scope.add(axis)
    model = Toy()
    _run_scope_around_forward(model, scope)
    out = model(torch.tensor([[1, 2]]), labels=torch.tensor([[1, 2]]))
    assert out["ids"].tolist() == [[6, 7]] and log[-1] == ("end", "cp", False)
    decode = model(torch.tensor([[3]]), position_ids=torch.tensor([[7]]))
    assert decode["ids"].tolist() == [[8]] and decode["positions"].tolist() == [[7]]
    axis.fail = True
    with pytest.raises(ValueError):
        model(torch.tensor([[1]]))
    axis.fail = False
    assert model(torch.tensor([[1]]))["ids"].tolist() == [[6]] and scope._open == []


def test_a_model_nobody_laid_out_has_the_one_process_state(tmp_path):
    from tptrain.models import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = AutoModelForCausalLM.from_config(config)
    state = model.parallel
    assert state.dims == ParallelDims() and state.mesh is None and not state.laid_out
    assert (model.tp_size, model.tp_plan, model.device_mesh) == (1, {}, None)
    assert state.scope.axes == [] and state.token_shard_groups() == []
    assert isinstance(state_of(nn.Linear(2, 2)), ParallelState)  # a plain module: the same default
