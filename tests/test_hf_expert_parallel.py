"""Expert parallelism on the transformers backend: transformers' experts split by expert over the TP group
(`enable_expert_parallel`: transformers' `base_model_ep_plan`, dispatched by all-to-all or summed by all-reduce) and
over an ep axis of their own (`DistributedConfig(ep_size=)`: attention data-parallel over ep, tokens dispatched by
all-to-all over it). qwen3_moe (forced onto the backend) and olmoe, tiny checkpoints written by transformers'
`save_pretrained` in the hub's per-expert layout (merged at load by transformers' conversions, each rank reading only
its experts); fp64, compared with transformers on one process (logits, loss) and with the backend on one process
(gradients, 3 AdamW steps). One job per world size runs every case.

    .venv/bin/python -m pytest tests/test_hf_expert_parallel.py -q
"""
from __future__ import annotations


import pytest
import torch

from tests.helpers.batches import batch, dp_batches
from tests.helpers.checkpoints import TransformersCheckpoints
from tests.helpers.compare import check_against_hf, full_grads, full_params, step_both
from tests.helpers.ranks import run_distributed

F64 = torch.float64
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=16, moe_intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, num_experts=8, num_experts_per_tok=2, output_router_logits=False)
TYPES = {"qwen3_moe": dict(norm_topk_prob=True), "olmoe": {}}
EXPERTS = "model.layers.0.mlp.experts"
TOL = dict(rtol=1e-6, atol=1e-6)  # transformers' norms and routers compute in fp32 in an fp64 model
STEP_TOL = dict(rtol=1e-5, atol=1e-5)
# world size: [(tp, ep)] on an ep axis of its own (tp 2 x ep 2: each expert also split over tp)
EP_AXIS = {2: [(1, 2)], 4: [(1, 4), (2, 2)]}


def _config(model_type: str, **overrides):
    import transformers
    return transformers.AutoConfig.for_model(model_type, **{**TINY, **TYPES.get(model_type, {}), **overrides})


def _references(hf) -> dict:
    """transformers' fp64 logits and loss on the shared batch() and on each ep rank's own batch (seed 10 + rank)."""
    out = {}
    with torch.no_grad():
        for key, seed in [("shared", 1), *((r, 10 + r) for r in range(4))]:
            ids, labels = batch(seed=seed)
            out[key] = {"logits": hf(ids).logits, "loss": hf(ids, labels=labels).loss.to(F64)}
    return out


# {model_type: (directory written by transformers, its references)}
CHECKPOINTS = TransformersCheckpoints({t: (t, {**TINY, **TYPES.get(t, {})}) for t in TYPES},
                                      reference=lambda hf: _references(hf.to(F64)))


def _trains_like(model, ref, what: str, dp=None) -> None:
    """Gradients and 3 AdamW steps of `model` equal the one-process `ref`. `dp` (an ep axis): each dp rank feeds its
    own batch (seed 10 + rank), `ref` the concatenation, every loss normalised by the global token count; the dense
    gradients are summed over dp as data parallelism does (the experts' are whole on their owners)."""
    batches = dp_batches(dp)
    specs = model.parallel.tp.specs
    # eps 1e-4: the router's softmax is fp32 in an fp64 model, and AdamW would turn its rounding (~1e-7 of gradients
    # that are ~0 for an expert few tokens reach) into whole steps of lr; a layout bug still moves every step by ~lr.
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4) for m in (ref, model)]
    for step in range(3):
        loss, ref_loss = step_both(ref, model, batches, dp, summed=lambda n: not specs[n].ep_split)
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{what} loss, step {step}: {m}")
        if step == 0:
            grads = full_grads(model)
            for n, p in ref.named_parameters():
                torch.testing.assert_close(grads[n], p.grad, **TOL, msg=lambda m: f"{what} grad of {n}: {m}")
        for opt in opts:
            opt.step(), opt.zero_grad()
    params = full_params(model)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(params[n], p.detach(), **STEP_TOL, msg=lambda m: f"{what} {n} after 3 steps: {m}")


def _over_tp(path, expected, ref, world: int, style: str | None) -> None:
    """enable_expert_parallel at tp = world: 'ep_dispatch_experts' as planned, or forced to `style`."""
    from tptrain import AutoModelForCausalLM, DistributedConfig
    overrides = {"layers.*.mlp.experts": style} if style else "auto"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(
        tp_size=world, enable_expert_parallel=True, backend="transformers", tp_plan=overrides))
    experts = model.get_submodule(EXPERTS)
    # the planned style picks by bytes sent (all_to_all_wins): k = 2 dispatches by all-to-all from 4 ranks on
    dispatch = {"ep_dispatch_experts_all_reduce": "all_reduce", "ep_dispatch_experts_all_to_all": "all_to_all",
                None: "all_to_all" if world >= 4 else "all_reduce"}[style]
    what = f"{model.config.model_type} tp={world} enable_expert_parallel {style or 'ep_dispatch_experts'}"
    assert model.backend == "transformers" and experts.tp_dispatch == dispatch, (what, experts.tp_dispatch)
    assert experts.gate_up_proj.shape[0] == TINY["num_experts"] // world, what  # whole experts
    check_against_hf(model, expected["shared"], what, TOL)
    _trains_like(model, ref, what)


def _over_ep_axis(path, expected, ref, tp: int, ep: int) -> None:
    """DistributedConfig(tp_size=tp, ep_size=ep): each dp rank its own batch, its experts read from the files."""
    from tptrain import AutoModelForCausalLM, DistributedConfig
    from tptrain.diagnostics.accounting import comm_report
    from tptrain.distributed.topology import dp_mesh
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(
        tp_size=tp, ep_size=ep, backend="transformers"))
    what = f"{model.config.model_type} tp={tp} ep_size={ep}"
    mesh, dp = model.device_mesh, dp_mesh(model.device_mesh)
    experts, held = model.get_submodule(EXPERTS), TINY["num_experts"] // ep
    assert model.tp_plan[EXPERTS] == "moe_tp_experts" and experts.ep_dispatch == "all_to_all", what
    first = mesh["ep"].get_local_rank() * held  # this rank's experts, each split over tp, as in the checkpoint
    stack = ref.get_submodule(EXPERTS).down_proj.detach()[first:first + held]
    assert torch.equal(full_params(model)[f"{EXPERTS}.down_proj"], ref.get_submodule(EXPERTS).down_proj.detach())
    assert torch.equal(experts.down_proj.detach(), stack.chunk(tp, dim=2)[mesh["tp"].get_local_rank()]), what
    ids, labels = batch(seed=10 + dp.get_local_rank())
    with torch.no_grad():
        mine = expected[dp.get_local_rank()]
        torch.testing.assert_close(model(ids).logits, mine["logits"], **TOL, msg=lambda m: f"{what} logits: {m}")
        torch.testing.assert_close(model(ids, labels=labels).loss, mine["loss"], **TOL)
    if tp == 1:  # the ep dispatch at its minimum: the counts, one row each way (tp > 1: tptrain's MoE only)
        report = comm_report(model, ids, labels)
        model.zero_grad()
        rows = [r for r in report.rows if r.op == "all_to_all"]
        assert rows and all((r.count, r.bytes) == (r.min_count, r.min_bytes) for r in rows), report.table()
    _trains_like(model, ref, what, dp=dp)


def _worker(world: int, checkpoints: dict) -> None:
    """Per type: the planned style over tp and the ep axis; qwen3_moe also the other dispatch, forced, and tp x ep."""
    import copy

    from tptrain.hf.model import TransformersCausalLM
    _bad_layouts_raise_on_every_rank()
    for model_type, (path, expected) in checkpoints.items():
        ref = TransformersCausalLM.from_pretrained(path, dtype=F64)
        forced = "ep_dispatch_experts_all_to_all" if world == 2 else "ep_dispatch_experts_all_reduce"
        for style in (None, forced) if model_type == "qwen3_moe" else (None,):
            _over_tp(path, expected, copy.deepcopy(ref), world, style)
        for tp, ep in EP_AXIS[world] if model_type == "qwen3_moe" else EP_AXIS[world][:1]:
            _over_ep_axis(path, expected, copy.deepcopy(ref), tp, ep)
        if model_type == "olmoe":  # world 2: ep 2 (FSDP2 over ep); world 4: tp 2 x FSDP2 2
            _trainer_with_fsdp(path, copy.deepcopy(ref), **(dict(ep=2) if world == 2 else dict(tp=2)))


def _trainer_with_fsdp(path, ref, *, tp: int = 1, ep: int | None = None) -> None:
    """The Trainer on the backend with FSDP2 over 2 dp ranks: at ep_size 2 (the dense parameters sharded over the ep
    ranks, each rank's experts its own) or at tp 2 (every expert split inside, FSDP2 cutting the stacks by expert).
    The experts' gate_up_proj is fused ([gate; up] halves split each alone, along dim 1): grad-norm clipping over
    all of it, and a DCP checkpoint at step 2 that saves its boxes without a gather. The losses of 3 steps, and of
    the third step resumed from the checkpoint, equal plain one-process training on the same global batches."""
    from tests.helpers.references import reference_losses
    from tests.helpers.trainer import tiny_dataset, training_args
    from tptrain import AutoModelForCausalLM, DistributedConfig
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer
    out, what = f"{path}-trainer-tp{tp}-ep{ep}", f"olmoe Trainer at tp {tp} ep_size {ep} on the backend"

    def trainer():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(
            tp_size=tp, ep_size=ep, backend="transformers"))
        # eps 1e-4: as _trains_like (the fp32 router's rounding would become whole steps of lr)
        args = training_args(out, max_steps=3, per_device_train_batch_size=2, adam_epsilon=1e-4, save_steps=2,
                             parallelism_config=ParallelismConfig(tp_size=tp, ep_size=ep, dp_shard_size=2))
        return Trainer(model=model, args=args, train_dataset=tiny_dataset())

    first = trainer()
    assert first.fsdp, what
    losses = first.train().losses
    resumed = trainer().train(resume_from_checkpoint=f"{out}/checkpoint-2").losses
    expected = reference_losses(ref.train(), tiny_dataset(), first.args, global_batch=4)
    torch.testing.assert_close(torch.tensor(losses + resumed), torch.tensor(expected + expected[2:]), **STEP_TOL,
                               msg=lambda m: f"{what} (+ the third step resumed): {m}")


def _bad_layouts_raise_on_every_rank() -> None:
    """Refused by the plan check on every rank, before the mesh's first collective."""
    from tptrain import DistributedConfig
    from tptrain.hf.model import TransformersCausalLM
    model = TransformersCausalLM.from_config(_config("qwen3_moe", num_experts=3), dtype=F64)
    with pytest.raises(ValueError, match=r"mlp.experts: num_experts=3 is not divisible by ep_size=2"):
        model.parallelize(DistributedConfig(ep_size=2, backend="transformers"))


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_transformers_and_one_process(checkpoints, world):
    run_distributed(_worker, world, world, checkpoints, timeout=600)


def _meta(model_type: str, **overrides):
    from tptrain.hf.model import TransformersCausalLM
    return TransformersCausalLM.from_config(_config(model_type, **overrides), device="meta")


def test_what_cannot_split_is_refused_naming_it():
    """Experts that do not split into equal shares, an experts module without transformers' experts interface under
    ep_size or an ep style: plan problems / errors naming the module, its size and the fix (before any collective)."""
    from tptrain.parallel.plan import check_plan
    six = _meta("qwen3_moe", num_experts=6)
    with pytest.raises(ValueError, match=r"ep_size=4:\n.*layers\.\*\.mlp\.experts: num_experts=6 is not divisible by "
                                         r"ep_size=4.*use an ep_size that divides 6"):
        check_plan(six, "auto", 1, ep_size=4).raise_problems(six)
    problems = check_plan(six, "auto", 4, expert_parallel=True).problems
    assert any("experts.gate_up_proj has shape (6, 32, 32)" in p and "'ep_dispatch_experts' at tp_size=4" in p
               for p in problems), problems
    llama4 = _meta("llama4_text", num_local_experts=4, intermediate_size=16)  # its experts take routed rows only
    problems = check_plan(llama4, "auto", 1, ep_size=2).problems
    assert any("feed_forward.experts (Llama4TextExperts) is not a stacked-experts module routed by expert ids" in p
               and "drop ep_size" in p for p in problems), problems
    with pytest.raises(TypeError, match=r"'ep_dispatch_experts' needs transformers' experts interface .* got a "
                                        r"Qwen3MoeSparseMoeBlock without \['num_experts', '_is_expert_parallel'\]"):
        check_plan(_meta("qwen3_moe"), {"layers.*.mlp": "ep_dispatch_experts"}, 2, expert_parallel=True)
    over = check_plan(_meta("qwen3_moe"), {"layers.*.mlp.experts": "ep_dispatch_experts_all_to_all"}, 2, ep_size=2)
    assert any("'ep_dispatch_experts_all_to_all', but with ep_size" in p and "'moe_tp_experts'" in p
               for p in over.problems), over.problems


def test_experts_no_token_reached_still_join_the_graph():
    """transformers' eager experts loop runs only the experts some row reached; on a rank whose experts no row reached
    the output must still depend on the rows and on every expert weight: else that rank's backward skips the
    collectives at its input boundaries (a mismatched collective across ranks) and AdamW skips its experts'
    weight decay and step count, which one process gives the whole stack (afmoe under enable_expert_parallel parted
    from one process at 2e-5 after 2 steps)."""
    import transformers

    from tptrain.parallel.dispatch import grouped_by_forward
    hf = transformers.AutoModelForCausalLM.from_config(_config("qwen3_moe")).to(F64)
    hf.set_experts_implementation("eager")
    experts = hf.get_submodule(EXPERTS)
    grouped = grouped_by_forward(experts, type(experts).forward)
    rows = torch.zeros(0, TINY["hidden_size"], dtype=F64, requires_grad=True)
    out = grouped(rows, [0] * TINY["num_experts"])
    assert out.shape == (0, TINY["hidden_size"]) and out.requires_grad
    (out.sum() + 1.0).backward()
    assert rows.grad is not None
    for name, p in experts.named_parameters():
        assert p.grad is not None and not p.grad.any(), name
