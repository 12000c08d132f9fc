"""The TP engine against the same model on one device: fp64, so a layout bug is an O(1) error."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.dist_utils import run_distributed
from tptrain import DistributedConfig
from tptrain.models import AutoConfig, AutoModelForCausalLM
from tptrain.distributed.comm import CommTracker
from tptrain.parallel.tensor_parallel import gather_full

TOL = dict(rtol=1e-10, atol=1e-10)

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
CONFIGS = {
    "qwen3": dict(model_type="qwen3", **TINY),
    "qwen2": dict(model_type="qwen2", **{**TINY, "head_dim": 16}),
    "llama_tied_llama3_rope": dict(model_type="llama", tie_word_embeddings=True, **{**TINY, "num_key_value_heads": 4},
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen3_one_kv_head": dict(model_type="qwen3", **{**TINY, "num_key_value_heads": 1}),
}


def make_config(name: str):
    kw = dict(CONFIGS[name])
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def batch(vocab: int, *, seed: int = 1, b: int = 2, s: int = 16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def full_grads(model) -> dict[str, torch.Tensor]:
    layout = model.tp_layout
    return {n: gather_full(p.grad, layout.specs[n], layout.ctx) for n, p in model.named_parameters()}


def full_params(model) -> dict[str, torch.Tensor]:
    layout = model.tp_layout
    return {n: gather_full(p.detach(), layout.specs[n], layout.ctx) for n, p in model.named_parameters()}


def assert_grads_match(model, ref, *, tol: dict = TOL, what: str = "grad") -> None:
    """Every gathered TP gradient equals the single-device one."""
    grads = full_grads(model)
    for n, p in ref.named_parameters():
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
