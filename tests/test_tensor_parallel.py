"""The TP engine against the same model on one device: fp64, so a layout bug is an O(1) error."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.batches import labelled_batch as batch
from tests.helpers.compare import assert_trains_like
from tests.helpers.configs import CONFIGS, make_config
from tests.helpers.ranks import run_distributed
from tptrain import DistributedConfig
from tptrain.distributed.comm import CommTracker
from tptrain.models import AutoModelForCausalLM

pytestmark = pytest.mark.distributed


def _equivalence_worker(name: str, tp: int, tp_plan="auto") -> None:
    torch.manual_seed(0)
    config = make_config(name)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    model = copy.deepcopy(ref).parallelize(DistributedConfig(tp_size=tp, tp_plan=tp_plan))
    assert model.tp_size == tp and model.device_mesh["tp"].size() == tp
    assert_trains_like(model, ref, *batch(config.vocab_size), what=f"{name} tp={tp}")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_single_device(name, tp):
    run_distributed(_equivalence_worker, tp, name, tp)


def test_consistent_override_matches_single_device():
    """Replicating the whole MLP (all three rules removed: the shapes meet) trains like one device."""
    mlp = {f"layers.*.mlp.{name}": None for name in ("gate_proj", "up_proj", "down_proj")}
    run_distributed(_equivalence_worker, 2, "qwen3", 2, mlp)


def _comm_count_worker(tp: int) -> None:
    torch.manual_seed(0)
    config = make_config("qwen3")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).parallelize(DistributedConfig(tp_size=tp))
    ids, labels = batch(config.vocab_size, b=2, s=8)
    with CommTracker() as t:
        model(ids, labels=labels).loss.backward()
    layers, act = config.num_hidden_layers, 2 * 8 * config.hidden_size * 8  # b * s * h fp64 bytes
    fwd = [r for r in t.records if r.phase == "forward"]
    bwd = [r for r in t.records if r.phase == "backward"]
    # Megatron minimum: 2 all-reduces per layer + the embedding forward, 2 per layer + the head's
    # input boundary backward, plus the vocab-parallel loss's all-reduces: fused with the head (issue 24), 2 per
    # chunk of tokens (one chunk here: the max, then [target, sum-exp]), the same bytes as 3 of (tokens,).
    assert [r.op for r in fwd] == ["all_reduce"] * (2 * layers + 1 + 2), t.records
    assert sum(r.bytes for r in fwd) == (2 * layers + 1) * act + 3 * 16 * 8
    assert [r.op for r in bwd] == ["all_reduce"] * (2 * layers + 1)
    assert sum(r.bytes for r in bwd) == (2 * layers + 1) * act
    # q_norm / k_norm weight gradients: one bucketed all-reduce per backward.
    assert t.counts("grad_sync") == {"all_reduce": 1}
    assert not any(r.op == "all_gather" for r in t.records), "no full-logit gather when a loss is computed"


@pytest.mark.parametrize("tp", [2, 4])
def test_collectives_are_the_megatron_minimum(tp):
    run_distributed(_comm_count_worker, tp, tp)
