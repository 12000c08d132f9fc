"""Overlapping the grad-input collective of column-parallel blocks (parallel/colwise_block.py) changes no bit:
loss, every gradient, a few AdamW steps and the collectives are identical with the overlap on and off.
On CPU the ranks use gloo (async work handles); with a GPU per rank the same tests run on NCCL."""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from tests.helpers.batches import labelled_batch as batch
from tests.helpers.configs import make_config
from tests.helpers.ranks import run_distributed
from tptrain import DistributedConfig
from tptrain.distributed.comm import CommTracker
from tptrain.models import AutoModelForCausalLM
from tptrain.parallel.colwise_block import OVERLAP_ENV, overlap_enabled
from tptrain.peft import LoraConfig, get_peft_model

MODELS = ("qwen3", "qwen2", "llama_tied_llama3_rope")  # q/k norms; q/k/v biases; MHA with a tied head


def _pair(base, tp: int, sp: bool) -> dict[bool, torch.nn.Module]:
    """The same model parallelized twice: overlap on (True) and off (False)."""
    out = {}
    for on in (True, False):
        model = copy.deepcopy(base).parallelize(DistributedConfig(tp_size=tp, enable_sequence_parallel=sp))
        model.parallel.tp.ctx.overlap = on
        out[on] = model
    return out


def _fused_blocks(model) -> list[str]:
    """Names of the colwise modules whose last output came from a fused block (recorded by _watch)."""
    return sorted(n for n, m in model.named_modules() if getattr(m, "_fused_out", False))


def _watch(model) -> None:
    def hook(module, args, out):
        module._fused_out = out.grad_fn is not None and out.grad_fn.name() == "_ArrivalBackward"

    for name, style in model.parallel.tp.plan.items():
        if style in ("colwise", "fused_colwise"):
            model.get_submodule(name).register_forward_hook(hook)


def _step(model, ids, labels, autocast: bool):
    """(loss, {name: local grad}, Counter of (phase, op, shape, bytes) of every collective)."""
    with CommTracker() as t:
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, labels=labels).loss
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, \
        Counter((r.phase, r.op, r.shape, r.bytes) for r in t.records)


def _assert_identical(models: dict, ids, labels, *, steps: int, what, autocast: bool = False) -> None:
    device = next(models[True].parameters()).device  # cuda:LOCAL_RANK (NCCL) where there is one GPU per rank
    ids, labels = ids.to(device), labels.to(device)
    opts = {on: torch.optim.AdamW(m.parameters(), lr=1e-2) for on, m in models.items()}
    for step in range(steps):
        (loss_on, grads_on, comm_on), (loss_off, grads_off, comm_off) = (_step(models[on], ids, labels, autocast)
                                                                         for on in (True, False))
        assert torch.equal(loss_on, loss_off), (what, step, loss_on, loss_off)
        differ = [n for n in grads_off if not torch.equal(grads_on[n], grads_off[n])]
        assert not differ, (what, step, differ)
        assert comm_on == comm_off, (what, step, comm_on - comm_off, comm_off - comm_on)
        for opt in opts.values():
            opt.step(), opt.zero_grad()
    params_off = dict(models[False].named_parameters())
    differ = [n for n, p in models[True].named_parameters() if not torch.equal(p, params_off[n])]
    assert not differ, (what, f"after {steps} AdamW steps", differ)


def _identical_worker(tp: int, sp: bool) -> None:
    for name in MODELS:
        for dtype in (torch.float64, torch.float32):
            torch.manual_seed(0)
            config = make_config(name)
            models = _pair(AutoModelForCausalLM.from_config(config, dtype=dtype), tp, sp)
            _watch(models[True]), _watch(models[False])
            ids, labels = batch(config.vocab_size)
            _assert_identical(models, ids, labels, steps=3, what=(name, dtype, tp, sp))
            # Every attention and MLP block ran fused with the overlap on, none with it off.
            fused = _fused_blocks(models[True])
            assert len(fused) == 5 * config.num_hidden_layers, fused  # q, k, v, gate, up per layer
            assert not _fused_blocks(models[False])


@pytest.mark.distributed
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_overlap_is_bit_identical(tp, sp):
    run_distributed(_identical_worker, tp, tp, sp, timeout=400)


def _other_paths_worker(tp: int) -> None:
    torch.manual_seed(0)
    config = make_config("qwen3")
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    ids, labels = batch(config.vocab_size)
    for sp in (False, True):
        # Activation checkpointing: the recomputed layers run the fused blocks again.
        models = _pair(base, tp, sp)
        for m in models.values():
            m.gradient_checkpointing_enable()
            m.train()
        _watch(models[True])
        _assert_identical(models, ids, labels, steps=2, what=("checkpointed", sp))
        assert len(_fused_blocks(models[True])) == 5 * config.num_hidden_layers

    # LoRA on q/v: that attention block falls back to the unfused path (the adapter adds its own gradient
    # term at the boundary); the MLP's gate/up stay fused. Trained adapters agree bit for bit.
    models = _pair(base, tp, False)
    for on, m in models.items():
        _watch(m)  # on the base modules, before LoRA wraps them
        torch.manual_seed(1)  # the adapters' init seed
        models[on] = get_peft_model(m, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    _assert_identical(models, ids, labels, steps=2, what="lora")
    assert [n.rsplit(".", 1)[-1] for n in _fused_blocks(models[True])] == ["gate_proj", "up_proj"] * 2

    # bf16 autocast: not fused (autocast would cast inside the block's backward differently), still identical.
    models = _pair(base.float(), tp, False)
    _watch(models[True])
    _assert_identical(models, ids, labels, steps=1, what="autocast", autocast=True)
    assert not _fused_blocks(models[True])


@pytest.mark.distributed
def test_overlap_falls_back_and_checkpoints():
    run_distributed(_other_paths_worker, 2, 2, timeout=400)


def test_switch(monkeypatch):
    monkeypatch.delenv(OVERLAP_ENV, raising=False)
    assert overlap_enabled()
    monkeypatch.setenv(OVERLAP_ENV, "0")
    assert not overlap_enabled()
    monkeypatch.setenv(OVERLAP_ENV, "yes")
    with pytest.raises(ValueError, match="TPTRAIN_OVERLAP='yes' must be 1"):
        overlap_enabled()


def _transformers_worker(path: str, tp: int) -> None:
    models = {}
    for on in (True, False):
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float64, distributed_config=DistributedConfig(tp_size=tp, backend="transformers"))
        assert model.backend == "transformers"
        model.parallel.tp.ctx.overlap = on
        _watch(model)
        models[on] = model
    ids, labels = batch(128)
    _assert_identical(models, ids, labels, steps=2, what="transformers backend")
    assert len(_fused_blocks(models[True])) == 5 * 2, _fused_blocks(models[True])  # q, k, v, gate, up; 2 layers


@pytest.mark.distributed
def test_transformers_backend(tmp_path):
    """transformers' Qwen3 modeling code on tptrain's engine: its q/k/v and gate/up blocks fuse alike."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64)
    transformers.Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    run_distributed(_transformers_worker, 2, str(tmp_path), 2, timeout=400)
