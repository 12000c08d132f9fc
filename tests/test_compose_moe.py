"""The compositions of issue 33 that meet the experts and the rotary embedding, each against one process in fp64
(3 AdamW steps: every step's loss, the first step's gradients, the parameters after the last):

* cp x ep: ep folded over dp_shard x cp (each rank routes its own tokens; the all-to-all runs over the ep group),
  at tp 2 x cp 2 x ep 2 (Qwen3-MoE, DeepSeek-V3), and the Trainer at dp_shard 2 x cp 2 x ep 2 (the experts FSDP2-
  sharded over dp_shard_mod_ep, everything else over dp_shard x cp), whose DCP checkpoint resumes in one process;
* the router aux loss under cp (the token counts summed over cp, each rank's share of the loss summed with it),
  under SP, and under pp (the statistics carried from stage to stage, the loss added on the last one: each
  pipeline microbatch is a forward of its own, as gradient accumulation makes it), with cp and with SP;
* longrope under cp: the whole sequence's length picks the long factors;
* SP with the MoE router styles (expert TP, expert parallelism summed or by all-to-all; the shared expert), with
  the aux loss and a padding mask, at tp 2 and at tp 2 x cp 2 x ep 2;
* SP on DeepSeek-V3's latent attention (the latents computed on the sequence shard and gathered by the per-head
  projections, the shared RoPE key gathered), low-rank q and one q_proj, at tp 2 and tp 2 x cp 2 x ep 2.

LoRA on experts over an ep axis is tests/test_lora_moe.py's. Worker pools: 2 ranks, then 4, then 1 process.

    .venv/bin/python -m pytest tests/test_compose_moe.py -q
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.helpers.batches import packed_batch
from tests.helpers.checkpoints import PerturbedCheckpoints
from tests.helpers.compare import TOL, full_grads, full_params
from tests.helpers.configs import CP_FAMILIES, F64, MOE_TRAIN_TINY
from tests.helpers.ranks import run_distributed
from tests.helpers.references import microbatch_reference, reference_losses
from tests.helpers.trainer import tiny_dataset, training_args
from tptrain import DistributedConfig
from tptrain.diagnostics.accounting import comm_report
from tptrain.models import AutoConfig, AutoModelForCausalLM

AUX = dict(output_router_logits=True, router_aux_loss_coef=0.5)  # a coefficient that makes its gradient count
LONGROPE = dict(rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.5], long_factor=[2.0, 3.0]),
                original_max_position_embeddings=12)  # seq 16: cp rank 1 holds positions up to 11 only
FAMILIES = {
    "qwen3_moe": ("qwen3_moe", dict(CP_FAMILIES["qwen3_moe"], **AUX)),
    "qwen2_moe": ("qwen2_moe", dict({k: v for k, v in CP_FAMILIES["qwen3_moe"].items() if k != "head_dim"},
                                    shared_expert_intermediate_size=24, **AUX)),  # a gated shared expert
    "deepseek_v3": ("deepseek_v3", CP_FAMILIES["deepseek_v3"]),  # group-limited router, shared experts, MLA
    "deepseek_v3_q_proj": ("deepseek_v3", dict(CP_FAMILIES["deepseek_v3"], q_lora_rank=None)),  # q from one q_proj
    "phi3_longrope": ("phi3", dict(CP_FAMILIES["phi3"], **LONGROPE)),
    "moe4": ("qwen3_moe", dict(MOE_TRAIN_TINY, num_experts_per_tok=2, num_hidden_layers=4, **AUX)),  # pp stages
}


CHECKPOINTS = PerturbedCheckpoints(FAMILIES)  # {name: directory}, its parameters away from their init


def _masked(batch: dict) -> dict:
    """The batch with a padding mask (the aux loss counts only the unpadded tokens)."""
    mask = torch.ones_like(batch["input_ids"])
    mask[1, -3:] = 0
    return {**batch, "attention_mask": mask}


def _trains_like(path: str, batch: dict, *, steps: int = 3, **distributed) -> None:
    """The model laid out as `distributed` (every rank given the same whole batch) equals one process: each step's
    loss (and aux loss, fp32 as transformers reports it), the first step's gradients (gathered over tp and ep), and
    every parameter after `steps` AdamW steps; and its collectives are `comm_report`'s minimum."""
    what = f"{path.rsplit('/', 1)[-1]} {distributed}"
    ref = AutoModelForCausalLM.from_pretrained(path).train()
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(**distributed)).train()
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        ref_out, out = ref(**batch), model(**batch)
        torch.testing.assert_close(out.loss, ref_out.loss, **TOL, msg=lambda m: f"{what} loss, step {step}: {m}")
        if ref_out.aux_loss is not None:
            torch.testing.assert_close(out.aux_loss, ref_out.aux_loss, rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"{what} aux loss, step {step}: {m}")
        ref_out.loss.backward(), out.loss.backward()
        if step == 0:
            grads = full_grads(model)
            for name, p in ref.named_parameters():
                if p.requires_grad:  # not DeepSeek's frozen e_score_correction_bias
                    torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m: f"{what} grad {name}: {m}")
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    params = full_params(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), **TOL, msg=lambda m: f"{what} {name} after {steps} "
                                                                                  f"AdamW steps: {m}")
    # one more step's collectives are the minimum (the experts' dispatch, SP's routing, the aux loss's sums)
    rest = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")}
    report = comm_report(model, batch["input_ids"], batch["labels"], **rest)
    assert report.matches_minimum, f"{what}\n{report.table()}"


# ---------------------------------------------------------------- the router aux loss under pp

def _pp_aux(path: str, tmp: str, schedules: tuple[str, ...], **sizes) -> None:
    """The Trainer at pp 2 (x `sizes`: cp 2, or tp 2 with SP) with the router aux loss equals one process running the
    same microbatches (each stage's statistics carried on; under cp and SP the counts summed over the token shards)."""
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    for schedule in schedules:
        what = f"pp 2 {sizes} {schedule} with the aux loss"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(
            pp_size=2, pp_schedule=schedule, **{"tp_size": 1, **sizes}))
        config = ParallelismConfig(pp_size=2, pp_schedule=schedule, pp_microbatches=2, cp_size=sizes.get("cp_size"))
        args = training_args(f"{tmp}/{''.join(c for c in what if c.isalnum())}", max_steps=3, parallelism_config=config)
        losses = Trainer(model, args=args, train_dataset=tiny_dataset()).train().losses
        expected, _ = microbatch_reference(AutoModelForCausalLM.from_pretrained(path, dtype=F64).train(), args,
                                           global_batch=args.per_device_train_batch_size, microbatches=2)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-10, atol=1e-10,
                                   msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- the Trainer at cp x ep, and its checkpoint

def _moe(aux: bool = False):
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", **{**MOE_TRAIN_TINY, "num_experts_per_tok": 2,
                                                  "output_router_logits": aux})
    return AutoModelForCausalLM.from_config(config, dtype=F64)


def _train(tmp: str, name: str, model, *, cp: int, ep: int | None, per_device: int, max_steps: int,
           resume: str | None = None) -> list[float]:
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    args = training_args(f"{tmp}/{name}", max_steps=max_steps, save_steps=2, per_device_train_batch_size=per_device,
                         parallelism_config=ParallelismConfig(cp_size=cp, ep_size=ep))
    return Trainer(model=model, args=args, train_dataset=tiny_dataset()).train(resume_from_checkpoint=resume).losses


def _trainer_cp_ep(tmp: str) -> None:
    """dp_shard 2 x cp 2 x ep 2 (the ep groups are the cp groups; each expert FSDP2-sharded over its 2 holders,
    dense layers over all 4 ranks): 6 steps at global batch 8 equal one process (aux off: under data parallelism
    each rank's aux loss is a function of its own batch); tp 2 x cp 2 x ep 2 with the aux loss: 3 steps."""
    ref = _moe()
    losses = _train(tmp, "dp2cp2ep2", copy.deepcopy(ref).parallelize(DistributedConfig(tp_size=1, cp_size=2, ep_size=2)),
                    cp=2, ep=2, per_device=4, max_steps=6)
    args = training_args(tmp, max_steps=6)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses(ref, tiny_dataset(), args, 8)),
                               rtol=1e-9, atol=1e-9, msg=lambda m: f"the Trainer at dp_shard 2 x cp 2 x ep 2: {m}")
    torch.save(losses, f"{tmp}/losses.pt")
    ref = _moe(aux=True)
    model = copy.deepcopy(ref).parallelize(DistributedConfig(tp_size=2, cp_size=2, ep_size=2))
    losses = _train(tmp, "tp2cp2ep2", model, cp=2, ep=2, per_device=4, max_steps=3)
    expected = reference_losses(ref, tiny_dataset(), training_args(tmp, max_steps=3), 4)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-9, atol=1e-9,
                               msg=lambda m: f"the Trainer at tp 2 x cp 2 x ep 2 with the aux loss: {m}")


def _resume_in_one_process(tmp: str) -> None:
    """The dp_shard 2 x cp 2 x ep 2 run's step-4 checkpoint (DCP, resharded) resumed in one process: its last two
    steps."""
    full = torch.load(f"{tmp}/losses.pt")
    resumed = _train(tmp, "one", _moe(), cp=1, ep=None, per_device=8, max_steps=6,
                     resume=f"{tmp}/dp2cp2ep2/checkpoint-4")
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[4:]), rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- the layout (no process group)

def test_ep_folds_over_dp_shard_x_cp():
    """ep over dp_shard x cp: the sizes resolved (tp taking what dp_shard x cp = ep leaves), the mesh's real axes
    (ep = dp_shard_in_ep x cp) read back by ParallelDims.of, and the sizes that cannot fold, before any collective."""
    from types import SimpleNamespace

    from tptrain.distributed import ParallelDims

    dims = DistributedConfig(cp_size=2, ep_size=2).parallel_dims(4)
    assert dims == ParallelDims(dp_replicate=1, dp_shard=1, tp=2, ep=2, cp=2)
    dims = DistributedConfig(tp_size=1, cp_size=2, ep_size=4, dp_replicate_size=2).parallel_dims(16)
    shape = dims.mesh_shape()
    assert shape == {"dp_replicate": 2, "dp_shard_mod_ep": 2, "dp_shard_in_ep": 2, "cp": 2, "tp": 1}
    assert ParallelDims.of(SimpleNamespace(mesh_dim_names=tuple(shape), shape=tuple(shape.values()))) == dims
    with pytest.raises(ValueError, match=r"ep_size=2 \(--ep-size\) is not a multiple of cp_size=4"):
        DistributedConfig(tp_size=1, cp_size=4, ep_size=2).parallel_dims(4)
    with pytest.raises(ValueError, match=r"ep_size=4 must divide dp_shard x cp = 1 x 2 .* launch a multiple of 8"):
        DistributedConfig(tp_size=2, cp_size=2, ep_size=4).parallel_dims(4)


# ---------------------------------------------------------------- the pools

SP = dict(tp_size=2, enable_sequence_parallel=True)
SP_LAYOUTS = [SP, dict(SP, enable_expert_parallel=True),  # summed (top-2 of 4 at 2 ranks), all-to-all
              dict(SP, tp_plan={"layers.*.mlp.experts": "expert_parallel_all_to_all"})]


def _two_ranks(paths: dict, tmp: str) -> None:
    _trains_like(paths["qwen3_moe"], _masked(packed_batch()), tp_size=1, cp_size=2)  # the aux loss under cp
    for packed in (False, True):  # the long factors (whole sequence of 16 > 12), the short ones (documents <= 9)
        _trains_like(paths["phi3_longrope"], packed_batch(seed=1, packed=packed), tp_size=1, cp_size=2)
    for family in ("qwen3_moe", "qwen2_moe"):
        for layout in SP_LAYOUTS:
            _trains_like(paths[family], _masked(packed_batch()), **layout)
    for family in ("deepseek_v3", "deepseek_v3_q_proj"):  # MLA under SP: the latents on the shard, the RoPE key gathered
        _trains_like(paths[family], packed_batch(), **SP)
    _pp_aux(paths["moe4"], tmp, ("1F1B", "Interleaved1F1B"))
    dist.barrier()


def _four_ranks(paths: dict, tmp: str) -> None:
    for family in ("qwen3_moe", "deepseek_v3"):
        _trains_like(paths[family], packed_batch(), tp_size=2, cp_size=2, ep_size=2)
    _trains_like(paths["deepseek_v3"], packed_batch(), **SP, cp_size=2, ep_size=2)
    _trains_like(paths["qwen2_moe"], _masked(packed_batch()), **SP, cp_size=2, ep_size=2)
    _trainer_cp_ep(tmp)
    _pp_aux(paths["moe4"], tmp, ("1F1B",), cp_size=2)
    _pp_aux(paths["moe4"], tmp, ("1F1B",), tp_size=2, enable_sequence_parallel=True)


@pytest.mark.distributed
def test_router_aux_loss_longrope_and_sp_with_experts_equal_one_process(checkpoints, tmp_path):
    """2 ranks: the aux loss at cp 2 (with padding) and at pp 2 (the Trainer, two schedules); longrope at cp 2 (long
    and short factors); SP at tp 2 on Qwen3-MoE and Qwen2-MoE (shared expert) in each expert style, and on
    DeepSeek-V3 (MLA)."""
    run_distributed(_two_ranks, 2, checkpoints, str(tmp_path), timeout=900)


@pytest.mark.distributed
def test_cp_x_ep_equals_one_process_and_resumes_in_one(checkpoints, tmp_path):
    """4 ranks: tp 2 x cp 2 x ep 2 on Qwen3-MoE (aux loss) and DeepSeek-V3, with SP on Qwen2-MoE and DeepSeek-V3; the
    Trainer at dp_shard 2 x cp 2 x ep 2 and tp 2 x cp 2 x ep 2 (aux loss), and the aux loss at pp 2 x cp 2 and
    pp 2 x tp 2 (SP); 1 process: the cp x ep checkpoint resumed."""
    run_distributed(_four_ranks, 4, checkpoints, str(tmp_path), timeout=1200)
    run_distributed(_resume_in_one_process, 1, str(tmp_path), timeout=300)
