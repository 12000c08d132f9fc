"""The Trainer against a single-device training loop: same global batches, same AdamW and schedule.

fp64 on CPU/gloo, so any layout or normalisation bug shows as an O(1) error, not noise. The
reference is written out by hand (torch AdamW, torch's clip_grad_norm_, a batch-mean loss), so it
checks the Trainer's token counting, gradient sums over TP / FSDP / DDP and global-norm clipping.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.references import reference_losses
from tests.helpers.trainer import tiny_dataset, tiny_model, training_args
from tptrain import DistributedConfig
from tptrain.distributed import ParallelDims
from tptrain.models import AutoModelForCausalLM
from tptrain.training.args import OPTIMIZERS, ParallelismConfig, TrainingArguments
from tptrain.training.optim import build_optimizer, lr_multiplier, param_groups
from tptrain.training.setup import optimizer_and_schedule, training_data
from tptrain.training.trainer import Trainer
from tptrain.distributed.comm import CommTracker

TOL = dict(rtol=1e-9, atol=1e-9)
BF16_TOL = dict(rtol=0, atol=0.05)  # bf16 compute against the fp64 curve: loss ~4.9, bf16 eps 2**-8


def _train_layout(output_dir, tp: int, *, rep: int = 1, shard: int | None = None, sp: bool = False, **kw):
    ref = tiny_model()
    # bf16 runs keep fp32 master weights, as a user would (autocast leaves fp64 alone).
    model = copy.deepcopy(ref).to(torch.float32 if kw.get("bf16") else torch.float64)
    if tp > 1:
        model.parallelize(DistributedConfig(tp_size=tp, enable_sequence_parallel=sp))
    args = training_args(output_dir, parallelism_config=ParallelismConfig(tp, dp_shard_size=shard,
                                                                          dp_replicate_size=rep), **kw)
    out = Trainer(model=model, args=args, train_dataset=tiny_dataset()).train()
    return ref, args, out


def _layouts_worker(tmp: str, cases: list[dict]) -> None:
    ref_cache: dict[tuple[int, int], list[float]] = {}
    for i, case in enumerate(cases):
        case = dict(case)
        global_batch = case.pop("global_batch")
        tol = case.pop("tol", TOL)
        ref, args, out = _train_layout(f"{tmp}/run{i}", **case)
        key = (global_batch, args.max_steps)
        if key not in ref_cache:
            ref_cache[key] = reference_losses(ref, tiny_dataset(), args, global_batch)
        expected = ref_cache[key]
        assert out.global_step == args.max_steps and len(out.losses) == args.max_steps
        torch.testing.assert_close(torch.tensor(out.losses), torch.tensor(expected), **tol,
                                   msg=lambda m: f"losses of layout {case}: {m}")
        if args.bf16:  # and bf16 really computed in bf16
            assert (torch.tensor(out.losses) - torch.tensor(expected)).abs().max() > 1e-6
        if args.save_steps:  # resumed from the middle, at the same layout: the same losses, bit for bit
            again = _train_layout(f"{tmp}/resumed{i}", resume_from_checkpoint=f"{tmp}/run{i}/checkpoint-10", **case)[2]
            assert again.losses == out.losses[10:], (again.losses, out.losses)
    if torch.distributed.get_rank() == 0:  # the consolidated checkpoint of the last run is the trained model
        saved = AutoModelForCausalLM.from_pretrained(out.final_dir, dtype=torch.float64)
        trained = tiny_model()
        reference_losses(trained, tiny_dataset(), args, global_batch)
        for name, p in trained.named_parameters():
            torch.testing.assert_close(saved.get_parameter(name), p, **TOL, msg=lambda m: f"saved {name}: {m}")
        lines = [json.loads(line) for line in open(f"{tmp}/run{len(cases) - 1}/metrics.jsonl")]
        assert [r["step"] for r in lines] == [5, 10, 15, 20] and "loss" in lines[0]


@pytest.mark.distributed
def test_tp2_and_gradient_accumulation(tmp_path):
    """TP 2 at batch 4, also with sequence parallelism; bf16 autocast loosely; TP 2 with 4 micro-batches
    of 1 (accumulation 4 x 1 == batch 4)."""
    run_distributed(_layouts_worker, 2, str(tmp_path), [
        dict(tp=2, global_batch=4),
        dict(tp=2, sp=True, global_batch=4),  # sequence-parallel norms: partial gradients summed per step
        dict(tp=2, bf16=True, max_steps=4, global_batch=4, tol=BF16_TOL),  # autocast (no FSDP)
        dict(tp=2, per_device_train_batch_size=1, gradient_accumulation_steps=4, global_batch=4),
    ])


@pytest.mark.distributed
def test_tp4_and_tp2_with_fsdp_hsdp_ddp(tmp_path):
    """4 ranks: TP 4; TP 2 x dp_shard 2 (FSDP2), dp_replicate 2 x dp_shard 2 (HSDP) and TP 2 x
    dp_replicate 2 (DDP) at the doubled batch; bf16 with activation checkpointing follows the fp64 curve
    loosely."""
    run_distributed(_layouts_worker, 4, str(tmp_path), [
        dict(tp=4, global_batch=4, save_steps=10),  # checkpoints with KV heads shared by 2 ranks
        dict(tp=2, shard=2, global_batch=8),
        dict(tp=2, shard=2, bf16=True, gradient_checkpointing=True, max_steps=4, global_batch=8, tol=BF16_TOL),
        dict(tp=1, shard=2, rep=2, global_batch=8, per_device_train_batch_size=2),  # HSDP, no TP
        dict(tp=2, shard=1, rep=2, global_batch=8, gradient_accumulation_steps=2, per_device_train_batch_size=2),
    ], timeout=400)


def _topology_worker(tmp: str) -> None:
    """One mesh, the model's; each step reduction over the sub-mesh it belongs to, labelled by what it is."""
    model = tiny_model().parallelize(DistributedConfig(tp_size=2))  # dp_shard 2 left over
    trainer = Trainer(model=model, args=training_args(f"{tmp}/a", parallelism_config=ParallelismConfig(2, 2)),
                      train_dataset=tiny_dataset())
    assert trainer.mesh is model.device_mesh
    with CommTracker() as t:
        trainer.training_step(trainer.data_order.next_batch())
    steps = {(r.phase, r.op, r.ranks) for r in t.records if r.phase in ("token_count", "loss", "grad_norm")}
    assert steps == {("token_count", "all_reduce", 2), ("loss", "all_reduce", 2), ("grad_norm", "all_reduce", 2)}
    assert [r.phase for r in t.records].count("grad_norm") == 2  # over tp, then over dp_shard
    assert not any(r.ranks == 4 for r in t.records if r.phase != "setup"), "nothing reduces over the whole world"

    # Loaded with dp_shard 2 left over, trained as TP 2 x dp_replicate 2: the model moves onto the run's mesh.
    model = tiny_model().parallelize(DistributedConfig(tp_size=2))
    trainer = Trainer(model=model, args=training_args(f"{tmp}/b", parallelism_config=ParallelismConfig(
        2, dp_shard_size=1, dp_replicate_size=2)), train_dataset=tiny_dataset())
    assert trainer.mesh is model.device_mesh and trainer.mesh["dp_replicate"].size() == 2
    assert model.parallel.tp.ctx.group_name == trainer.mesh["tp"].get_group().group_name


@pytest.mark.distributed
def test_one_mesh_and_reductions_over_sub_meshes(tmp_path):
    run_distributed(_topology_worker, 4, str(tmp_path))


def test_schedule_param_groups_and_argument_checks():
    linear = lr_multiplier("linear", warmup_steps=4, total_steps=10)
    assert [linear(s) for s in (0, 2, 4, 7, 10, 12)] == [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    cosine = lr_multiplier("cosine", warmup_steps=2, total_steps=12)
    torch.testing.assert_close(torch.tensor([cosine(s) for s in (1, 2, 7, 12)], dtype=torch.float64),
                               torch.tensor([0.5, 1.0, 0.5, 0.0], dtype=torch.float64))

    model = tiny_model(attention_bias=True)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    undecayed = {names[id(p)] for p in no_decay["params"]}
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    assert undecayed == {n for n in names.values() if n.endswith((".bias", "norm.weight"))}
    assert "model.layers.0.self_attn.q_norm.weight" in undecayed and "model.layers.0.self_attn.q_proj.bias" in undecayed

    with pytest.raises(ValueError, match="lr_scheduler_type='poly'"):
        TrainingArguments(output_dir="x", lr_scheduler_type="poly")
    with pytest.raises(ValueError, match="optim='adafactor' is not one of"):
        TrainingArguments(output_dir="x", optim="adafactor")
    assert TrainingArguments(output_dir="x").optim == "adamw_torch_fused"  # transformers' name, the default
    models = {o: copy.deepcopy(model).double() for o in OPTIMIZERS}
    for optim, m in models.items():  # the same update up to rounding
        opt = build_optimizer(m, TrainingArguments(output_dir="x", optim=optim, learning_rate=1e-2, weight_decay=0.1))
        assert bool(opt.defaults["fused"]) == (optim == "adamw_torch_fused")
        for _ in range(3):
            m(torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(models["adamw_torch_fused"].named_parameters(), models["adamw_torch"].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    assert not torch.equal(a, model.get_parameter(name).double())  # the steps moved it
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be a positive int, got 0"):
        TrainingArguments(output_dir="x", gradient_accumulation_steps=0)


def test_setup_data_stage_is_pure_and_the_schedule_reads_its_steps():
    """Stage 2 of the Trainer's set-up: rows, eval rows, global batch and max_steps as values, no process group,
    the arguments untouched; the schedule ends at the steps it computed."""
    built = []

    def build(rows: int) -> list[int]:
        built.append(rows)
        return list(range(rows))

    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2)
    args = TrainingArguments(output_dir="x", per_device_train_batch_size=2, gradient_accumulation_steps=3,
                             eval_split=0.25, num_train_epochs=1.5)
    with CommTracker() as tracker:  # an earlier test of this process may have left a process group up
        data = training_data(args, dims, 40, None, build=build)
    assert (len(data.train), len(data.eval), data.global_batch) == (30, 10, 12)
    assert data.max_steps == 3 and args.max_steps == 100 and built == [40]  # ceil(1.5 * (30 // 12)), args as given
    assert not tracker.records  # no collective: a pure stage
    with pytest.raises(ValueError, match="either eval_dataset or TrainingArguments.eval_split"):
        training_data(args, dims, 40, 5, build=build)
    assert built == [40, 40]  # the training rows are built (and checked) first, as they always were
    plain = dict(output_dir="x", per_device_train_batch_size=2)
    with pytest.raises(ValueError, match="save_best need an eval set"):
        training_data(TrainingArguments(**plain, eval_steps=5), dims, 8, None, build=build)
    given = training_data(TrainingArguments(**plain), dims, 8, 3, build=build)
    assert (len(given.train), len(given.eval), given.max_steps) == (8, 3, 100)
    _, schedule = optimizer_and_schedule(torch.nn.Linear(2, 2), args, data.max_steps)
    assert schedule.lr_lambdas[0](data.max_steps - 1) > 0.0 == schedule.lr_lambdas[0](data.max_steps)
