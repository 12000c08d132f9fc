"""from_pretrained against transformers 5.23 as the oracle, at tp 1, 2 and 4 (fp32, CPU/gloo).

Three tiny checkpoints written by transformers' own save_pretrained (one sharded with an index):
Llama with llama3 rope scaling and tied embeddings, Qwen2 with attention bias and 4:1 GQA, Qwen3 with
q/k norms and head_dim != hidden/heads. Every distributed check of one world size runs in one spawned
job (spawning costs seconds per rank).

    .venv/bin/python -m pytest tests/test_from_pretrained.py -q
"""
from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from tests.helpers.batches import batch as _batch
from tests.helpers.checkpoints import TransformersCheckpoints
from tests.helpers.ranks import run_distributed
from tests.helpers.references import logits_and_loss
from tptrain import AutoModelForCausalLM, DistributedConfig

TOL = dict(rtol=2e-5, atol=2e-5)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256)
FAMILIES = {
    "llama": dict(TINY, model_type="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # one KV head: KV replicated on every rank at tp 2 and 4
    "qwen2": dict(TINY, model_type="qwen2", num_attention_heads=4, num_key_value_heads=1, rope_theta=1e6),
    "qwen3": dict(TINY, model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=24),
}
SHARDED = "qwen2"  # saved with a small max_shard_size: the index path
HUB_ID, HUB_REV = "tiny-org/tiny-qwen3", "0123456789abcdef0123456789abcdef01234567"


def _move_norms_and_biases(hf, seed: int, norm_weight: float) -> None:
    """Norms and biases away from their 1/0 init, so they are really tested (torch's seed continuing from the init)."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn(p.shape) * 0.2)


# {family: (directory written by transformers, its logits and loss on _batch())}; SHARDED's with an index
CHECKPOINTS = TransformersCheckpoints(
    {name: (kw["model_type"], {k: v for k, v in kw.items() if k != "model_type"}) for name, kw in FAMILIES.items()},
    seed=None, perturb=_move_norms_and_biases, max_shard_size={SHARDED: "40KB"},
    reference=lambda hf: logits_and_loss(hf, *_batch()))


def _check(model, expected, what: str) -> None:
    ids, labels = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected["logits"], **TOL, msg=lambda m: f"{what} logits: {m}")
        torch.testing.assert_close(model(ids, labels=labels).loss, expected["loss"], **TOL,
                                   msg=lambda m: f"{what} loss: {m}")


def test_tp1_matches_transformers(checkpoints):
    for name, (path, expected) in checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert model.tp_size == 1 and model.device_mesh is None
        _check(model, expected, f"{name} tp=1")


def _tp2_worker(checkpoints, save_root) -> None:
    for name, (path, expected) in checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     distributed_config=DistributedConfig(tp_size=2))
        assert model.tp_size == 2
        assert model.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "cp", "tp")  # cp of size 1
        assert model.device_mesh["tp"].size() == 2
        assert model.tp_plan["model.layers.1.self_attn.q_proj"] == "colwise"
        assert model.tp_plan["model.layers.0.mlp.down_proj"] == "rowwise"
        assert model.tp_plan["lm_head"] == "colwise_gather_output"
        assert model.model.layers[0].mlp.up_proj.weight.shape == (48, 64)  # only this rank's half
        _check(model, expected, f"{name} tp=2")
        ids, labels = _batch()
        local = model(ids, labels=labels, return_logits=True).logits  # with labels the logits stay vocab-sharded
        rank = model.parallel.tp.ctx.rank
        torch.testing.assert_close(local, expected["logits"].chunk(2, dim=-1)[rank], **TOL)
        model.save_pretrained(save_root / name)
        if name == "qwen3":
            model.save_pretrained(save_root / "qwen3_sharded", max_shard_size="40KB")

    with pytest.warns(FutureWarning, match="distributed_config"):  # tp_size inferred from WORLD_SIZE too
        model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"][0], dtype=torch.float32, tp_plan="auto")
    assert model.tp_size == 2
    _check(model, checkpoints["qwen3"][1], "qwen3 tp_plan=auto (deprecated kwarg)")

    groups = len(torch.distributed.distributed_c10d._world.pg_map)
    again = AutoModelForCausalLM.from_pretrained(HUB_ID, dtype=torch.float32,  # HF_HUB_OFFLINE=1, fake cache
                                                 distributed_config=DistributedConfig(tp_size=2))
    _check(again, checkpoints["qwen3"][1], f"hub id {HUB_ID}")
    # Every model of one layout shares one mesh: a load makes no new process group (each holds sockets and threads
    # until the process group is closed; a script loading many models gathered them without end).
    assert again.device_mesh is model.device_mesh
    assert len(torch.distributed.distributed_c10d._world.pg_map) == groups


def _fake_hub_cache(hf_home, checkpoint_dir) -> None:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<rev>/files}."""
    repo = hf_home / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    shutil.copytree(checkpoint_dir, repo / "snapshots" / HUB_REV)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_REV)


@pytest.mark.distributed
def test_tp2_matches_transformers_and_saves_for_transformers(checkpoints, tmp_path, monkeypatch):
    _fake_hub_cache(tmp_path / "hf_home", checkpoints["qwen3"][0])
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # read by the spawned ranks' huggingface_hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    run_distributed(_tp2_worker, 2, checkpoints, tmp_path / "saved")
    import transformers

    # What tptrain saved at tp 2 is one consolidated checkpoint that transformers loads unchanged.
    ids, labels = _batch()
    for name in [*FAMILIES, "qwen3_sharded"]:
        saved = tmp_path / "saved" / name
        assert (saved / "model.safetensors.index.json").exists() == (name == "qwen3_sharded")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
        got = logits_and_loss(hf, ids, labels)
        expected = checkpoints[name.removesuffix("_sharded")][1]
        torch.testing.assert_close(got["logits"], expected["logits"], **TOL, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(got["loss"], expected["loss"], **TOL)


def _tp4_worker(checkpoints) -> None:
    for name, (path, expected) in checkpoints.items():
        config = DistributedConfig() if name == "llama" else DistributedConfig(tp_size=4)  # None -> WORLD_SIZE
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=config)
        assert model.tp_size == 4 and model.device_mesh["tp"].size() == 4
        n_kv = FAMILIES[name]["num_key_value_heads"]
        assert model.parallel.tp.specs["model.layers.0.self_attn.k_proj.weight"].replicas == 4 // n_kv
        _check(model, expected, f"{name} tp=4 ({n_kv} KV heads)")


@pytest.mark.distributed
def test_tp4_matches_transformers_with_kv_replication(checkpoints):
    run_distributed(_tp4_worker, 4, checkpoints)
