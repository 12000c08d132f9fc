"""Resumable checkpoints written from each rank's own FSDP x TP shard (2-D DTensor placements).

At TP 2 x FSDP 2 (4 ranks): the DCP state aliases the training tensors (nothing gathered or copied), the
saved chunks are each rank's own (strided offsets where FSDP and TP both split dim 0; shared KV chunks
written once at TP 4), and the checkpoint resumes at the same layout bit for bit and at TP 1 x FSDP 4 /
TP 4 / HSDP to the uninterrupted run's losses. A checkpoint written by the earlier format (every tensor
gathered over dp: tests/data/ckpt_v1_tp2_fsdp2, made by that code) still resumes.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from tests.helpers.ranks import run_distributed
from tests.helpers.trainer import tiny_dataset, tiny_model, training_args
from tptrain import AutoConfig, AutoModelForCausalLM, DistributedConfig
from tptrain.training.checkpoint import state as ckpt
from tptrain.training.args import ParallelismConfig
from tptrain.training.trainer import Trainer

pytestmark = pytest.mark.distributed

DATA = Path(__file__).parent / "data"
TOL = dict(rtol=1e-6, atol=1e-6)


# Phi-3: fused qkv_proj (rows q 64, k 32, v 32) and gate_up_proj, the packed tensors.
PHI3 = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, partial_rotary_factor=0.5, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)


def phi3_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("phi3", **PHI3), dtype=torch.float64)


def _run(output_dir, tp: int, shard: int, batch: int, *, rep: int = 1, make=tiny_model, **kw):
    """Train the tiny model at tp x dp_shard x dp_replicate (global batch 4) to max_steps (default 6)."""
    model = make()
    if tp > 1:
        model = model.parallelize(DistributedConfig(tp_size=tp))
    args = training_args(output_dir, **{"max_steps": 6, **kw}, save_steps=2, save_total_limit=2,
                         per_device_train_batch_size=batch,
                         parallelism_config=ParallelismConfig(tp, dp_shard_size=shard, dp_replicate_size=rep))
    return Trainer(model=model, args=args, train_dataset=tiny_dataset()).train()


def _chunks(path: Path, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata[key]
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks)


def _aliasing(tmp: str) -> None:
    """Every view in the saved state is the training tensor's own storage, at its own global offset."""
    model = tiny_model().parallelize(DistributedConfig(tp_size=2))
    trainer = Trainer(model=model, args=training_args(tmp, max_steps=1, parallelism_config=ParallelismConfig(
        2, dp_shard_size=2), per_device_train_batch_size=2), train_dataset=tiny_dataset())
    trainer.training_step(trainer.data_order.next_batch())
    state = ckpt.build_state(trainer.inner, trainer.optimizer, trainer.converter, for_load=False)
    for name, p in trainer.inner.named_parameters():
        assert isinstance(p, DTensor), name  # an FSDP shard
        moments = trainer.optimizer.state[p]
        for view, own in ((state["model"][name], p), (state["optim"][name]["exp_avg"], moments["exp_avg"]),
                          (state["optim"][name]["exp_avg_sq"], moments["exp_avg_sq"])):
            assert view.shape == model.parallel.tp.global_shapes[name], (name, view.shape)
            assert view.to_local().data_ptr() == own.to_local().data_ptr(), f"{name} was copied"
    # The dp shard of the TP shard, at its global place (the TP rank's rows, then FSDP's half of them).
    view = state["model"]["model.layers.0.self_attn.q_proj.weight"]
    full = trainer.inner.get_parameter("model.layers.0.self_attn.q_proj.weight").full_tensor()  # (TP shard)
    rank = torch.distributed.get_rank()  # (dp_shard, tp) = divmod(rank, 2)
    dp_rank = rank // 2
    torch.testing.assert_close(view.to_local(), full.chunk(2)[dp_rank], rtol=0, atol=0)
    assert view.placements[1].__class__.__name__ == "_StridedShard", view.placements


def _reshard_worker(tmp: str) -> None:
    _aliasing(f"{tmp}/alias")
    full = _run(f"{tmp}/a", 2, 2, 2)  # checkpoints 4 and 6 kept
    ck = Path(f"{tmp}/a/checkpoint-4")
    # Each rank wrote its own quarter: TP splits k_proj's 16 rows in 2, FSDP each half in 2 again.
    assert _chunks(ck, "model.model.layers.0.self_attn.k_proj.weight") == [
        ((0, 0), (4, 32)), ((4, 0), (4, 32)), ((8, 0), (4, 32)), ((12, 0), (4, 32))]
    assert _chunks(ck, "optim.model.layers.1.mlp.down_proj.weight.exp_avg") == [  # rowwise: TP on dim 1
        ((0, 0), (16, 24)), ((0, 24), (16, 24)), ((16, 0), (16, 24)), ((16, 24), (16, 24))]

    same = _run(f"{tmp}/b", 2, 2, 2, resume_from_checkpoint=ck)
    assert same.losses == full.losses[4:], (same.losses, full.losses)  # bit-identical at the same layout
    for tp, shard, rep, batch in ((1, 4, 1, 1), (4, 1, 1, 4), (2, 1, 2, 2)):  # (2, 1, 2): HSDP's replicas
        other = _run(f"{tmp}/c{tp}{shard}{rep}", tp, shard, batch, rep=rep, resume_from_checkpoint=ck)
        torch.testing.assert_close(torch.tensor(other.losses), torch.tensor(full.losses[4:]), **TOL)
    # HSDP: the two dp_replicate copies of each shard are written once.
    assert _chunks(Path(f"{tmp}/c212/checkpoint-6"), "model.model.layers.0.self_attn.k_proj.weight") == [
        ((0, 0), (8, 32)), ((8, 0), (8, 32))]
    # TP 4 over 2 KV heads: each KV chunk is held by 2 ranks and written once.
    tp4 = Path(f"{tmp}/c411/checkpoint-6")
    assert _chunks(tp4, "model.model.layers.0.self_attn.k_proj.weight") == [((0, 0), (8, 32)), ((8, 0), (8, 32))]
    # ... and that checkpoint resumes at TP 2 x FSDP 2 as at TP 4 (continued to step 8 both ways).
    ref = _run(f"{tmp}/d", 4, 1, 4, max_steps=8, resume_from_checkpoint=tp4)
    back = _run(f"{tmp}/e", 2, 2, 2, max_steps=8, resume_from_checkpoint=tp4)
    torch.testing.assert_close(torch.tensor(back.losses), torch.tensor(ref.losses), **TOL)


def test_reshard_from_2d_shards(tmp_path):
    run_distributed(_reshard_worker, 4, str(tmp_path), timeout=600)


def _packed_worker(tmp: str) -> None:
    full = _run(f"{tmp}/a", 2, 2, 2, make=phi3_model)
    ck = Path(f"{tmp}/a/checkpoint-4")
    # TP rank 0 holds q rows 0-31, k 64-79, v 96-111; FSDP gives its dp rank 0 the q rows, dp rank 1 k and v.
    assert _chunks(ck, "model.model.layers.0.self_attn.qkv_proj.weight") == [
        ((0, 0), (32, 64)), ((32, 0), (32, 64)), ((64, 0), (16, 64)), ((80, 0), (16, 64)), ((96, 0), (16, 64)),
        ((112, 0), (16, 64))]
    same = _run(f"{tmp}/b", 2, 2, 2, make=phi3_model, resume_from_checkpoint=ck)
    assert same.losses == full.losses[4:], (same.losses, full.losses)
    for tp, shard, batch in ((4, 1, 4), (1, 4, 1)):
        other = _run(f"{tmp}/c{tp}", tp, shard, batch, make=phi3_model, resume_from_checkpoint=ck)
        torch.testing.assert_close(torch.tensor(other.losses), torch.tensor(full.losses[4:]), **TOL)
    # TP 4: the KV segments' chunks are each held by 2 ranks and written once (with FSDP off: dp 1).
    tp4 = _chunks(Path(f"{tmp}/c4/checkpoint-6"), "optim.model.layers.1.self_attn.qkv_proj.weight.exp_avg")
    assert tp4 == [((r, 0), (16, 64)) for r in range(0, 64, 16)] + [((r, 0), (16, 64)) for r in range(64, 128, 16)]


def test_packed_tensors_saved_from_their_pieces(tmp_path):
    run_distributed(_packed_worker, 4, str(tmp_path), timeout=600)


def _old_format_worker(tmp: str) -> None:
    losses = json.loads((DATA / "ckpt_v1_tp2_fsdp2_losses.json").read_text())  # its run's 6 steps
    ck = Path(tmp) / "checkpoint-4"
    for tp, shard, batch in ((2, 2, 2), (4, 1, 4)):
        out = _run(f"{tmp}/r{tp}", tp, shard, batch, resume_from_checkpoint=ck)
        torch.testing.assert_close(torch.tensor(out.losses), torch.tensor(losses[4:]), **TOL)


def test_checkpoint_of_earlier_format_resumes(tmp_path):
    shutil.copytree(DATA / "ckpt_v1_tp2_fsdp2", tmp_path / "checkpoint-4")
    run_distributed(_old_format_worker, 4, str(tmp_path), timeout=400)
