"""Expert parallelism on an axis of its own (`DistributedConfig(ep_size=)`): experts split by expert over ep ranks
taken from data parallelism, each expert tensor-parallel over tp; attention and dense layers TP over tp and
data-parallel over dp_shard (ep included). Each ep rank feeds its OWN batch.

Checked against transformers on each rank's batch (fp64) and against one device on the concatenated batch
(gradients of the summed per-rank losses, each normalised by the global token count), at (tp 1, ep 2) on 2 ranks
and (tp 2, ep 2), (tp 1, ep 4) on 4; a batch routed so only one rank's experts get tokens (no hang, zero gradients
elsewhere); save_pretrained reloaded by transformers; the Trainer (FSDP2, HSDP, clipping) against one device; DCP
checkpoints resumed across ep/tp layouts; `tptrain train/plan --ep-size`; the size errors, raised before any
collective. The distributed checks share one chain of worker pools (2, then 4 ranks, then 1 process).

    .venv/bin/python -m pytest tests/test_moe_ep.py -q
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from tests.helpers.batches import batch
from tests.helpers.checkpoints import TransformersCheckpoints
from tests.helpers.compare import MOE_HF_TOL as HF_TOL, TOL, full_grads, route_to_first_rank
from tests.helpers.configs import F64, MOE_FAMILIES as FAMILIES, MOE_TINY as TINY, MOE_TRAIN_TINY as TRAIN_TINY
from tests.helpers.launch import tptrain_train
from tests.helpers.ranks import run_distributed
from tests.helpers.references import hf_reference, reference_losses, transformers_fp64
from tests.helpers.trainer import tiny_dataset, training_args
from tptrain import AutoModelForCausalLM, DistributedConfig
from tptrain.diagnostics.accounting import comm_report
from tptrain.distributed.topology import dp_mesh
from tptrain.models import AutoConfig
from tptrain.parallel.plan import check_plan

LAYOUTS = {2: [(1, 2)], 4: [(2, 2), (1, 4)]}  # world size: [(tp, ep)]


# {model_type: directory written by transformers} for two families (shared expert: qwen2_moe)
CHECKPOINTS = TransformersCheckpoints({t: (t, dict(TINY, **FAMILIES[t][2])) for t in ("qwen3_moe", "qwen2_moe")})


def _global_batch(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every dp rank's own batch (seed 10 + rank), concatenated in rank order."""
    parts = [batch(seed=10 + r) for r in range(dp)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _no_aux(model):
    # The aux loss is a function of each rank's own tokens (as under any data parallelism), not of the global batch.
    model.config.output_router_logits = False
    return model


def _check_layout(path, tp: int, ep: int, *, route_first: bool = False) -> None:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64,
                                                 distributed_config=DistributedConfig(tp_size=tp, ep_size=ep))
    mesh, dp = model.device_mesh, dp_mesh(model.device_mesh)
    assert mesh["ep"].size() == ep and mesh["tp"].size() == tp and dp.size() == dist.get_world_size() // tp
    experts, inner = model.model.layers[0].mlp.experts, model.config.moe_intermediate_size
    assert tuple(experts.gate_proj.shape) == (4 // ep, inner // tp, 64)  # E/ep experts x 1/tp of each
    assert experts.expert_offset == mesh["ep"].get_local_rank() * (4 // ep)
    rank = dp.get_local_rank()
    ids, labels = batch(seed=10 + rank)
    if not route_first:  # transformers on this rank's own batch
        hf = transformers_fp64(path)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, hf(ids).logits, **HF_TOL)
            torch.testing.assert_close(model(ids, labels=labels).loss, hf(ids, labels=labels).loss.to(F64),
                                       **HF_TOL)
    ref = _no_aux(AutoModelForCausalLM.from_pretrained(path, dtype=F64))
    _no_aux(model)
    if route_first:
        route_to_first_rank(ref, 4 // ep)
        route_to_first_rank(model, 4 // ep)
    all_ids, all_labels = _global_batch(dp.size())
    count = int((all_labels[:, 1:] != -100).sum())
    ref(all_ids, labels=all_labels, num_items_in_batch=count).loss.backward()
    model(ids, labels=labels, num_items_in_batch=count).loss.backward()
    # Dense gradients summed over data parallelism (ep included), as FSDP does in training; the experts' are whole
    # on their owners already (dp_shard == ep here: no other rank holds the same experts).
    for name, p in model.named_parameters():
        if ".experts." not in name:
            dist.all_reduce(p.grad, group=dp.get_group())
    grads = full_grads(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m: f"tp {tp} ep {ep} grad of {name}: {m}")
    model.zero_grad()
    report = comm_report(model, ids, labels)  # the ep dispatch: one row per assignment each way, and the counts
    rows = [r for r in report.rows if r.op == "all_to_all" or tp > 1]  # tp 1: no TP minimum (size-1 all-reduces)
    assert rows and all((r.count, r.bytes) == (r.min_count, r.min_bytes) for r in rows), report.table()
    if route_first:
        held = [p.grad for p in experts.parameters()]
        if mesh["ep"].get_local_rank() > 0:
            assert all(torch.count_nonzero(g) == 0 for g in held)
        else:
            assert torch.count_nonzero(experts.down_proj.grad) > 0


def _worker(checkpoints, world: int, save_dir) -> None:
    for tp, ep in LAYOUTS[world]:
        for path in checkpoints.values():
            _check_layout(path, tp, ep)
        _check_layout(checkpoints["qwen3_moe"], tp, ep, route_first=True)
    tp, ep = LAYOUTS[world][0]
    model = AutoModelForCausalLM.from_pretrained(checkpoints["qwen2_moe"], dtype=F64,
                                                 distributed_config=DistributedConfig(tp_size=tp, ep_size=ep))
    model.save_pretrained(save_dir / f"qwen2_moe-{world}")


def _moe_config(**kw):
    return AutoConfig.for_model("qwen3_moe", **{**TINY, "num_experts": 4, "moe_intermediate_size": 16, **kw})


@pytest.mark.parametrize("kwargs, world, match", [
    (dict(ep_size=2, enable_expert_parallel=True), 2, "pass one of them"),
    (dict(ep_size=0), 2, "ep_size must be a positive int, got 0"),
    (dict(ep_size=2.0), 2, "ep_size must be a positive int, got 2.0"),
    (dict(tp_size=2, ep_size=2), 2, r"must divide the data-parallel shard degree dp_shard=1 .* launch a multiple of 4"),
    (dict(ep_size=4, dp_shard_size=6), 6, "ep_size that divides 6"),
])
def test_bad_ep_sizes_are_value_errors(kwargs, world, match):
    with pytest.raises(ValueError, match=match):
        DistributedConfig(**kwargs).parallel_dims(world)


def test_ep_sizes_resolve():
    assert DistributedConfig(ep_size=2).sizes(2) == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "ep": 2}
    dims = DistributedConfig(tp_size=2, ep_size=4).parallel_dims(8)
    assert (dims.dp_shard, dims.tp, dims.ep) == (4, 2, 4)
    # the ep group: dp_shard_in_ep x cp (flattened into "ep" by the mesh; cp 1 here)
    assert dims.mesh_shape() == {"dp_replicate": 1, "dp_shard_mod_ep": 1, "dp_shard_in_ep": 4, "cp": 1, "tp": 2}
    assert DistributedConfig(ep_size=2, dp_shard_size=4).parallel_dims(4).mesh_shape()["dp_shard_mod_ep"] == 2
    assert "ep" not in DistributedConfig(ep_size=1).sizes(2)  # ep 1: no expert parallelism, the mesh of today


def test_ep_size_plan_problems_name_the_sizes():
    model = AutoModelForCausalLM.from_config(_moe_config(num_experts=6), device="meta")
    with pytest.raises(ValueError, match=r"ep_size=4:\n.*num_experts=6 is not divisible by ep_size=4"):
        check_plan(model, "auto", 1, ep_size=4).raise_problems(model)
    model = AutoModelForCausalLM.from_config(_moe_config(), device="meta")
    over = check_plan(model, {"layers.*.mlp.experts": "expert_parallel_all_reduce"}, 2, ep_size=2).problems
    assert any("'expert_parallel_all_reduce'" in p and "drop ep_size" in p for p in over), over
    dense = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("qwen3", **{k: v for k, v in TINY.items() if "expert" not in k and "router" not in k}),
        device="meta")
    with pytest.raises(ValueError, match="'qwen3'.*has no experts to split"):
        check_plan(dense, "auto", 1, ep_size=2)
    assert all(s.ep_split for n, s in check_plan(model, "auto", 1, ep_size=2).specs.items() if ".experts." in n)


# ---------------------------------------------------------------- training

def _moe():
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", **{**TRAIN_TINY, "num_experts_per_tok": 2,
                                                  "output_router_logits": False})
    return AutoModelForCausalLM.from_config(config, dtype=F64)


def _trainer_worker(tmp: str) -> None:
    """4 ranks: (tp 1, ep 2, dp_shard 4: each expert FSDP-sharded over its 2 replicas), (tp 2, ep 2, dp_shard 2:
    one owner per expert) and HSDP: a few clipped AdamW steps equal one device's at the global batch, and the final model
    (save_pretrained, gathered over FSDP, ep and tp) is the single-device model to transformers."""
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer
    # the third: loaded at dp_shard 4, trained as HSDP (dp_replicate 2 x dp_shard 2, ep 2): the model moves onto
    # the run's mesh, whose ep groups hold the same ranks
    for i, (tp, ep, rep) in enumerate([(1, 2, 1), (2, 2, 1), (1, 2, 2)]):
        model = _moe().parallelize(DistributedConfig(tp_size=tp, ep_size=ep))
        args = training_args(f"{tmp}/run{i}", max_steps=4, logging_steps=1,
                             parallelism_config=ParallelismConfig(ep_size=ep, dp_replicate_size=rep))
        out = Trainer(model=model, args=args, train_dataset=tiny_dataset()).train()
        ref = _moe()
        expected = reference_losses(ref, tiny_dataset(), args, global_batch=4 * (4 // tp))
        torch.testing.assert_close(torch.tensor(out.losses), torch.tensor(expected), rtol=1e-9, atol=1e-9)
        if dist.get_rank() == 0:
            from tptrain.training.reporting import read_metrics
            norms = [r["grad_norm"] for r in read_metrics(f"{tmp}/run{i}/metrics.jsonl")]
            assert len(norms) == 4 and min(norms) > args.max_grad_norm, norms  # clipped: a wrong norm shows
            ids = batch()[0]
            with torch.no_grad():
                torch.testing.assert_close(transformers_fp64(f"{tmp}/run{i}/final")(ids).logits, ref(ids).logits,
                                           **HF_TOL)
    model = _moe().parallelize(DistributedConfig(ep_size=2))
    with pytest.raises(ValueError, match=r"ParallelismConfig\(ep_size=4\) disagrees with the model.*ep_size=2"):
        Trainer(model=model, args=training_args(f"{tmp}/bad", parallelism_config=ParallelismConfig(ep_size=4)),
                train_dataset=tiny_dataset())


@pytest.mark.distributed
def test_tptrain_train_ep_size_cli(tmp_path):
    """`tptrain train --ep-size 2` trains an MoE model at (tp 1, ep 2) on 2 processes, with its checkpoints, and
    saves a model that loads; a dense model and an ep size that does not divide the data-parallel ranks are refused
    up front, before any worker starts."""
    import json
    import shutil

    from tptrain.training.reporting import read_metrics
    bundled = tptrain_train.__globals__["ROOT"] / "tptrain" / "data" / "tiny-qwen3"
    model_dir = tmp_path / "tiny-moe"
    shutil.copytree(bundled, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=64, num_hidden_layers=2)
    (model_dir / "config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    run = tptrain_train("--model", str(model_dir), "--tp-size", "1", "--ep-size", "2", "--nproc-per-node", "2",
                        "--output-dir", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "world size 2, tp 1, ep 2" in run.stdout, run.stdout
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    assert final.model.layers[0].mlp.experts.gate_proj.shape[0] == 4  # gathered over ep

    for flags, message in [(("--ep-size", "2", "--tp-size", "1", "--nproc-per-node", "2"), "'qwen3'"),
                           (("--model", str(model_dir), "--ep-size", "2", "--tp-size", "1", "--nproc-per-node", "3"),
                            "launch a multiple of 2 processes")]:
        bad = tptrain_train(*flags, "--output-dir", str(tmp_path / "bad"))
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_plan_shows_experts_per_rank_over_the_ep_axis(tmp_path, capsys):
    from tptrain.cli import main
    from tptrain.diagnostics.plan_report import plan_report
    config = AutoConfig.for_model("qwen3_moe", **{**TINY, "num_experts": 8, "moe_intermediate_size": 16})
    config.save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path), "--tp-size", "2", "--ep-size", "4"]) == 0
    assert "2 expert(s) per rank" in capsys.readouterr().out
    assert main(["plan", str(tmp_path), "--tp-size", "2", "--ep-size", "3"]) == 2  # 8 experts do not split in 3
    text = plan_report(config, 2, ep_size=4).text
    assert "ep_size=4" in text, text
    assert "2 expert(s) per rank (ep rank e holds experts e*2 .. e*2+1), each split 1/2" in text, text
    assert "expert bytes per rank: 24.58 KB of 196.61 KB" in text, text  # 1/8 of every expert byte: 2 of 8, 1/2 each
    assert "3 all-to-alls over the 4 ep ranks" in text and "layout OK" in text, text
    bad = plan_report(AutoConfig.for_model("qwen3_moe", **{**TINY, "num_experts": 6}), 1, ep_size=4)
    assert any("num_experts=6 is not divisible by ep_size=4" in p for p in bad.problems), bad.problems


# ---------------------------------------------------------------- resuming across layouts

def _resume_run(tmp: str, name: str, tp: int, ep: int | None, per_device: int, resume: str | None = None,
                max_steps: int = 6):
    """6 steps at global batch 8 (checkpoints every 2), or the last ones resumed from `resume`."""
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer
    model = _moe()
    if dist.is_initialized() or tp * (ep or 1) > 1:
        model = model.parallelize(DistributedConfig(tp_size=tp, ep_size=ep))
    args = training_args(f"{tmp}/{name}", max_steps=max_steps, save_steps=2, per_device_train_batch_size=per_device,
                         parallelism_config=ParallelismConfig(tp, ep_size=ep), resume_from_checkpoint=resume)
    return Trainer(model=model, args=args, train_dataset=tiny_dataset()).train().losses


def _resume_worker_2(tmp: str) -> None:
    """Trained at (tp 1, ep 2); resumed with expert TP at tp 2 (no ep axis) from its step-4 checkpoint."""
    full = _resume_run(tmp, "a", 1, 2, per_device=4)
    torch.save(full, f"{tmp}/losses.pt")
    resumed = _resume_run(tmp, "b", 2, None, per_device=8, resume=f"{tmp}/a/checkpoint-4")
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[4:]), rtol=1e-9, atol=1e-9)


def _resume_worker_4(tmp: str) -> None:
    """Resumed at (tp 2, ep 2) and at (tp 1, ep 2, dp_shard 4: each expert FSDP-sharded over its 2 replicas)."""
    full = torch.load(f"{tmp}/losses.pt")
    for name, tp, per_device in (("c", 2, 4), ("d", 1, 2)):
        resumed = _resume_run(tmp, name, tp, 2, per_device=per_device, resume=f"{tmp}/a/checkpoint-4")
        torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[4:]), rtol=1e-9, atol=1e-9,
                                   msg=lambda m: f"resumed at tp {tp} ep 2: {m}")
    # ... and each one's step-6 checkpoint resumed at the other's layout: the same 2 further steps
    swapped = _resume_run(tmp, "e", 2, 2, per_device=4, resume=f"{tmp}/d/checkpoint-6", max_steps=8)
    other = _resume_run(tmp, "f", 1, 2, per_device=2, resume=f"{tmp}/c/checkpoint-6", max_steps=8)
    assert len(swapped) == 2
    torch.testing.assert_close(torch.tensor(swapped), torch.tensor(other), rtol=1e-9, atol=1e-9)


def _resume_worker_1(tmp: str) -> None:
    full = torch.load(f"{tmp}/losses.pt")
    resumed = _resume_run(tmp, "g", 1, None, per_device=8, resume=f"{tmp}/a/checkpoint-4")
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[4:]), rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- one chain of worker pools for all of it

def _bad_layouts_raise_on_every_rank() -> None:
    """Raised identically on every rank by the plan check, before the mesh's first collective."""
    dense = AutoConfig.for_model("qwen3", **{k: v for k, v in TINY.items() if "expert" not in k and "router" not in k})
    for config, match in [(_moe_config(num_experts=3), "num_experts=3 is not divisible by ep_size=2"),
                          (dense, "'qwen3'.*has no experts to split")]:
        with pytest.raises(ValueError, match=match):
            AutoModelForCausalLM.from_config(config, dtype=F64).parallelize(DistributedConfig(ep_size=2))
    with pytest.raises(ValueError, match="launch a multiple of 4 processes"):
        AutoModelForCausalLM.from_config(_moe_config(), dtype=F64).parallelize(DistributedConfig(tp_size=2,
                                                                                                 ep_size=2))


def _two_ranks(checkpoints, tmp) -> None:
    _bad_layouts_raise_on_every_rank()
    _worker(checkpoints, 2, tmp)
    _resume_worker_2(str(tmp))


def _four_ranks(checkpoints, tmp) -> None:
    _worker(checkpoints, 4, tmp)
    _trainer_worker(str(tmp))
    _resume_worker_4(str(tmp))


@pytest.mark.distributed
def test_ep_axis_forward_gradients_training_saving_and_resuming(checkpoints, tmp_path):
    """2 ranks: transformers / one-device checks at (tp 1, ep 2), a DCP run at (tp 1, ep 2) resumed at tp 2; 4 ranks:
    the checks at (tp 2, ep 2) and (tp 1, ep 4), the Trainer, the resumes at ep 2; 1 process: the resume there.
    save_pretrained at both world sizes reloads in transformers with the original logits."""
    run_distributed(_two_ranks, 2, checkpoints, tmp_path, timeout=600)
    run_distributed(_four_ranks, 4, checkpoints, tmp_path, timeout=900)
    run_distributed(_resume_worker_1, 1, str(tmp_path), timeout=300)
    want = hf_reference(transformers_fp64(checkpoints["qwen2_moe"]))
    for world in (2, 4):  # gathered over ep and tp, in the hub's per-expert layout
        got = hf_reference(transformers_fp64(tmp_path / f"qwen2_moe-{world}"))
        torch.testing.assert_close(got["logits"], want["logits"], rtol=0, atol=0)
