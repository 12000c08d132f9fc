"""The user-facing communication report and the saved-activation meter."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.helpers import batch, make_config
from tptrain import DistributedConfig
from tptrain.models import AutoModelForCausalLM
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
        if sp:  # the norms' weights are partial too: 2 per layer + the final norm
            sync = layers * norms + (2 * layers + 1) * config.hidden_size * 8
            assert minimum == {("forward", "reduce_scatter"): (n, n * act),
                               ("forward", "all_gather"): (n, n * act // tp),
                               ("forward", "all_reduce"): (3, 3 * tokens),
                               ("backward", "all_gather"): (2 * n, 2 * n * act // tp),
                               ("backward", "reduce_scatter"): (n, n * act),
                               ("grad_sync", "all_reduce"): (1, sync)}
        else:
            assert minimum == {("forward", "all_reduce"): (n + 3, n * act + 3 * tokens),
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
