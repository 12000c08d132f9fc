"""The user-facing communication report and the saved-activation meter."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.helpers.batches import labelled_batch as batch
from tests.helpers.configs import TP_TINY as TINY, make_config
from tests.helpers.ranks import run_distributed
from tptrain import DistributedConfig
from tptrain.distributed import comm
from tptrain.models import AutoConfig, AutoModelForCausalLM
from tptrain.diagnostics.accounting import CommReport, CommRow, SavedTensorMeter, comm_report, megatron_minimum


def test_meter_counts_each_saved_storage_once_and_skips_parameters():
    w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    with SavedTensorMeter([w]) as meter:
        y = (x @ w).sin()  # mm saves x (and w: excluded); sin saves its input x @ w
        z = x.view(2, 16) * 2.0  # a view of x: the same storage, not counted again
    assert meter.bytes == 2 * 4 * 8 * 8
    (y.sum() + z.sum()).backward()
    with SavedTensorMeter() as meter, torch.no_grad():
        (x @ w).sin()
    assert meter.bytes == 0


def _report_worker() -> None:
    torch.manual_seed(0)
    config = make_config("qwen3")
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    b, s, tp, layers = 2, 8, 2, config.num_hidden_layers
    ids, labels = batch(config.vocab_size, b=b, s=s)
    act, tokens = b * s * config.hidden_size * 8, b * s * 8
    norms = 2 * config.head_dim * 8  # q_norm + k_norm weights of one layer (replicated: one slot)
    reports = {}
    for sp in (False, True):
        model = copy.deepcopy(ref).parallelize(DistributedConfig(tp_size=tp, enable_sequence_parallel=sp))
        reports[sp] = report = comm_report(model, ids, labels)
        assert report.matches_minimum, report.table()
        assert report.full_logit_collectives == 0
        minimum = megatron_minimum(model, b, s)
        n = 2 * layers + 1
        # Issue 24: the loss fused with the head takes 2 all-reduces per chunk of tokens (one chunk here), the bytes
        # of 3 (tokens,) ones, and under SP keeps no head input to re-gather in backward.
        if sp:  # the norms' weights are partial too: 2 per layer + the final norm
            sync = layers * norms + (2 * layers + 1) * config.hidden_size * 8
            assert minimum == {("forward", "reduce_scatter"): (n, n * act),
                               ("forward", "all_gather"): (n, n * act // tp),
                               ("forward", "all_reduce"): (2, 3 * tokens),
                               ("backward", "all_gather"): (2 * n - 1, (2 * n - 1) * act // tp),
                               ("backward", "reduce_scatter"): (n, n * act),
                               ("grad_sync", "all_reduce"): (1, sync)}
        else:
            assert minimum == {("forward", "all_reduce"): (n + 2, n * act + 3 * tokens),
                               ("backward", "all_reduce"): (n, n * act),
                               ("grad_sync", "all_reduce"): (1, layers * norms)}
        assert "above minimum" not in report.table()
        assert ("reduce_scatter" in report.table()) == sp
    assert reports[True].saved_activation_bytes < reports[False].saved_activation_bytes


@pytest.mark.distributed
def test_comm_report_matches_megatron_minimum():
    run_distributed(_report_worker, 2)


def test_report_flags_collectives_above_the_minimum():
    rows = [CommRow("forward", "all_reduce", 8, 800, 8, 800), CommRow("forward", "all_gather", 1, 4096, 0, 0)]
    report = CommReport(2, False, rows, saved_activation_bytes=0, full_logit_collectives=1)
    assert not report.matches_minimum
    lines = report.table().splitlines()
    assert "above minimum" in lines[3] and "above minimum" not in lines[2]
    assert "full-logit collectives: 1" in lines[-1]


class _NoteInBackward(torch.autograd.Function):
    """identity fwd and bwd, noting one row in each (the phase a recomputed forward's note gets)."""

    @staticmethod
    def forward(ctx, x):
        comm.note("rows_received", 1, "g")
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        comm.note("rows_received", 1, "g")
        return grad


def test_tracker_notes_sum_per_group_and_phase_and_cost_nothing_untracked():
    comm.note("rows_received", 7, "g")  # no tracker: dropped
    with comm.CommTracker() as tracker:
        comm.note("rows_received", 5, "g")
        comm.note("rows_received", 3, "other")
        _NoteInBackward.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert [(n.value, n.group, n.phase) for n in tracker.notes] == [(5, "g", "forward"), (3, "other", "forward"),
                                                                    (1, "g", "forward"), (1, "g", "backward")]
    assert tracker.noted("rows_received", "g") == 6 and tracker.noted("rows_received", "other") == 3
    assert tracker.noted("rows_received", "g", phase="backward") == 1 and tracker.records == []


def _ep_report_worker() -> None:
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", **{**TINY, "num_experts": 4, "num_experts_per_tok": 2,
                                                  "moe_intermediate_size": 16, "output_router_logits": False})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).parallelize(DistributedConfig(ep_size=2))
    ids, labels = batch(config.vocab_size, seed=1 + dist.get_rank())  # each ep rank routes its own tokens
    report = comm_report(model, ids, labels)
    a2a = [r for r in report.rows if r.op == "all_to_all"]
    assert a2a and all((r.count, r.bytes) == (r.min_count, r.min_bytes) for r in a2a), report.table()
    blocks = [m for m in model.modules() if hasattr(m, "router_logits")]
    assert blocks and not any(hasattr(b.experts, "rows_received") for b in blocks)  # the tracker holds it
    # The rows this rank's experts received: every rank's routing of the last forward, counted here.
    mine = torch.zeros((), dtype=torch.int64)
    for block in blocks:
        ids_here = torch.topk(block.router_logits, config.num_experts_per_tok, dim=-1).indices
        every = [torch.empty_like(ids_here) for _ in range(dist.get_world_size())]
        dist.all_gather(every, ids_here)
        lo, hi = block.experts.expert_offset, block.experts.expert_offset + block.experts.gate_proj.shape[0]
        mine += sum(((i >= lo) & (i < hi)).sum() for i in every)
    with comm.CommTracker() as tracker:
        model(ids, labels=labels)
    assert tracker.noted("rows_received", model.parallel.tp.ctx.ep_group_name) == int(mine)
    with pytest.raises(ValueError, match="pass the CommTracker that recorded the step"):
        megatron_minimum(model, *ids.shape)


@pytest.mark.distributed
def test_ep_dispatch_minimum_reads_the_rows_received_from_the_tracker():
    run_distributed(_ep_report_worker, 2)


def _deepseek_report_worker() -> None:
    from tests.helpers.configs import DEEPSEEK_TINY

    torch.manual_seed(0)
    config = type(AutoConfig.for_model("deepseek_v3")).from_dict({"model_type": "deepseek_v3", **DEEPSEEK_TINY})
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    with torch.no_grad():  # a correction bias that changes the choice: the router's picks are not the logits' top-k
        for block in (m for m in ref.modules() if hasattr(m, "router_logits")):
            block.gate.e_score_correction_bias.copy_(torch.randn(config.num_experts, dtype=torch.float64))
    b, s, tp = 2, 8, 2
    ids, labels = batch(config.vocab_size, b=b, s=s)
    layouts = {"expert tp": DistributedConfig(tp_size=tp),
               "all-to-all over tp": DistributedConfig(tp_size=tp, tp_plan={"layers.*.mlp.experts":
                                                                            "expert_parallel_all_to_all"}),
               "ep 2": DistributedConfig(ep_size=2)}
    for what, layout in layouts.items():
        model = copy.deepcopy(ref).parallelize(layout)
        shard = (ids, labels) if what != "ep 2" else batch(config.vocab_size, b=b, s=s, seed=1 + dist.get_rank())
        report = comm_report(model, *shard)
        assert report.matches_minimum and report.rows, f"{what}\n{report.table()}"
        rows = {(r.phase, r.op): (r.count, r.bytes) for r in report.rows}
        if what == "expert tp":
            # Per MLA layer 3 narrow backward boundaries: q_b_proj's input (q_lora_rank), kv_b_proj's (kv_lora_rank)
            # and the shared RoPE key's gradient (qk_rope_head_dim); then the dense MLP's, the MoE block's and the
            # head's (hidden), and the routing weights' gradient (tokens, top-k). Forward: o_proj's and the MLPs' sums
            # (the MoE layer's experts and its shared experts' down_proj one each), the embedding's, and the loss's 2.
            layers, token = config.num_hidden_layers, b * s * 8
            narrow = config.q_lora_rank + config.kv_lora_rank + config.qk_rope_head_dim
            assert rows[("backward", "all_reduce")] == (3 * layers + 4, token * (layers * narrow + 3 * config.hidden_size
                                                                                 + config.num_experts_per_tok))
            assert rows[("forward", "all_reduce")][0] == 2 * layers + 2 + 2
        elif what == "all-to-all over tp":  # the grouped router's picks, not the logits' top-k, are what moved
            block = next(m for m in model.modules() if hasattr(m, "router_logits"))
            x = torch.randn(b * s, config.hidden_size, dtype=torch.float64)
            logits, _, chosen = block.gate(x)
            top = torch.topk(logits, config.num_experts_per_tok, dim=-1).indices
            assert not torch.equal(chosen.sort(-1).values, top.sort(-1).values)
            assert rows[("forward", "all_to_all")][0] == 3 * sum(config.layer_is_moe)
        else:
            assert set(rows) == {("forward", "all_to_all"), ("backward", "all_to_all")}, report.table()


@pytest.mark.distributed
def test_deepseek_latent_attention_and_grouped_router_at_their_minimum():
    """DeepSeek-V3 at tp 2 (expert TP; experts dispatched by all-to-all over tp) and at ep 2: comm_report's minimum
    equals what the tracker counted, counts and bytes."""
    run_distributed(_deepseek_report_worker, 2)
