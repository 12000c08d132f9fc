"""Training a mixture-of-experts model with the Trainer: at ep 2 (experts split by expert, dispatched by
all-to-all) its losses are a single-device loop's, and its DCP checkpoint resumes at another layout (tp 2 with
expert tensor parallelism, one process) with the uninterrupted run's losses.

    .venv/bin/python -m pytest tests/test_moe_training.py -q
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.configs import MOE_TRAIN_TINY as TINY
from tests.helpers.launch import tptrain_train
from tests.helpers.ranks import run_distributed
from tests.helpers.references import reference_losses
from tests.helpers.trainer import tiny_dataset, training_args
from tptrain import DistributedConfig
from tptrain.models import AutoConfig, AutoModelForCausalLM
from tptrain.training.args import ParallelismConfig
from tptrain.training.trainer import Trainer

pytestmark = pytest.mark.distributed


def tiny_moe():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **TINY), dtype=torch.float64)


def _run(output_dir, model, tp: int, *, shard: int | None = None, **kw):
    args = training_args(output_dir, max_steps=6, save_steps=2, save_total_limit=2,
                         parallelism_config=ParallelismConfig(tp, dp_shard_size=shard), **kw)
    return Trainer(model=model, args=args, train_dataset=tiny_dataset()).train(), args


def _worker(tmp: str) -> None:
    ep = tiny_moe().parallelize(DistributedConfig(tp_size=2, enable_expert_parallel=True))
    assert ep.tp_plan["model.layers.0.mlp.experts"] == "expert_parallel"
    assert ep.model.layers[0].mlp.experts.gate_proj.shape[0] == 2  # this rank's 2 of the 4 experts
    full, args = _run(f"{tmp}/a", ep, 2)
    expected = reference_losses(tiny_moe(), tiny_dataset(), args, global_batch=4)
    torch.testing.assert_close(torch.tensor(full.losses), torch.tensor(expected), rtol=1e-9, atol=1e-9)

    etp = tiny_moe().parallelize(DistributedConfig(tp_size=2))  # resumed with each expert split inside instead
    resumed, _ = _run(f"{tmp}/b", etp, 2, resume_from_checkpoint=f"{tmp}/a/checkpoint-4")
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(full.losses[4:]), rtol=1e-9, atol=1e-9)
    torch.save(full.losses, f"{tmp}/losses.pt")


def _one_process_worker(tmp: str) -> None:
    """Resumed in one process (the same global batch of 4: with data parallelism instead, each rank's aux loss would
    see only its own tokens, a different objective, as in transformers)."""
    plain, _ = _run(f"{tmp}/c", tiny_moe(), 1, resume_from_checkpoint=f"{tmp}/a/checkpoint-4")
    full = torch.load(f"{tmp}/losses.pt")
    torch.testing.assert_close(torch.tensor(plain.losses), torch.tensor(full[4:]), rtol=1e-9, atol=1e-9)


def test_train_at_ep2_matches_one_device_and_resumes_at_tp2_and_in_one_process(tmp_path):
    run_distributed(_worker, 2, str(tmp_path), timeout=500)
    run_distributed(_one_process_worker, 1, str(tmp_path), timeout=300)


def test_tptrain_train_expert_parallel_cli(tmp_path):
    """`tptrain train --expert-parallel` trains an MoE model from its config (the bundled tokenizer) at ep 2; on a
    dense model the flag is refused up front, before any worker starts."""
    import json
    import shutil

    from tptrain.models import AutoModelForCausalLM
    from tptrain.training.reporting import read_metrics
    bundled = tptrain_train.__globals__["ROOT"] / "tptrain" / "data" / "tiny-qwen3"
    model_dir = tmp_path / "tiny-moe"
    shutil.copytree(bundled, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                  num_experts_per_tok=1, moe_intermediate_size=128, num_hidden_layers=2)
    (model_dir / "config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    run = tptrain_train("--model", str(model_dir), "--expert-parallel", "--output-dir", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    assert final.config.model_type == "qwen3_moe" and final.model.layers[0].mlp.experts.gate_proj.shape[0] == 4

    dense = tptrain_train("--expert-parallel", "--output-dir", str(tmp_path / "dense"))
    assert dense.returncode != 0 and "--expert-parallel" in dense.stderr, dense.stderr
    assert "mixture-of-experts" in dense.stderr and "Traceback" not in dense.stderr, dense.stderr


def _fsdp_worker(tmp: str) -> None:
    """ep 2 x dp_shard 2 (FSDP2 over every parameter, experts included: each expert's shard over its 2 replicas)
    and ep 2 with activation checkpointing: the single-device losses at the doubled batch. The aux loss is off
    here: under data parallelism each rank's aux loss sees only its own tokens (a different objective)."""
    def moe():
        torch.manual_seed(0)
        config = AutoConfig.for_model("qwen3_moe", **{**TINY, "output_router_logits": False})
        return AutoModelForCausalLM.from_config(config, dtype=torch.float64)

    for i, kw in enumerate([{}, {"gradient_checkpointing": True}]):
        model = moe().parallelize(DistributedConfig(tp_size=2, enable_expert_parallel=True))  # dp_shard 2 left over
        args = training_args(f"{tmp}/run{i}", max_steps=6, parallelism_config=ParallelismConfig(2, dp_shard_size=2),
                             **kw)
        out = Trainer(model=model, args=args, train_dataset=tiny_dataset()).train()
        expected = reference_losses(moe(), tiny_dataset(), args, global_batch=8)
        torch.testing.assert_close(torch.tensor(out.losses), torch.tensor(expected), rtol=1e-9, atol=1e-9)


def test_ep2_with_fsdp2_and_activation_checkpointing_match_one_device(tmp_path):
    run_distributed(_fsdp_worker, 4, str(tmp_path), timeout=500)


VIEW_WARNING = "returned a view tensor"


def _view_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if VIEW_WARNING in str(w.message)]


def _no_view_output_worker(tmp: str) -> None:
    """The experts under FSDP2 return a tensor of their own: the all-to-all path's all-gathered output (experts
    wrapped by fully_shard on their own) and a Trainer run with dp_shard over the experts (ep 2) raise no "returned a
    view tensor" warning, and the collectives' results are no views of their buffers (bit for bit the gather)."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    ids = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(3))
    losses = []
    for wrap in (False, True):
        model = tiny_moe().parallelize(DistributedConfig(tp_size=2, enable_expert_parallel=True))
        assert model.model.layers[0].mlp.experts.tp_dispatch == "all_to_all"  # top-1 at 2 ranks
        if wrap:
            for layer in model.model.layers:
                fully_shard(layer.mlp.experts, mesh=model.device_mesh["dp_shard"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = model(ids, labels=ids).loss
            loss.backward()
        assert not _view_warnings(caught), _view_warnings(caught)
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1]), losses

    from tptrain.distributed import comm
    group, rank = dist.group.WORLD, dist.get_rank()
    for shape, dim in [((3, 4), 0), ((1, 3, 4), 1), ((2, 3, 4), 1), ((1, 1, 4), 2), ((2, 3, 4), -1)]:
        x = torch.arange(24.0)[:torch.Size(shape).numel()].reshape(shape) + 100 * rank
        gathered = comm.gather_from_tp(x, group, dim=dim)
        assert gathered._base is None and gathered.is_contiguous(), (shape, dim)
        torch.testing.assert_close(gathered, torch.cat([x - 100 * rank, x - 100 * rank + 100], dim=dim), rtol=0, atol=0)
        summed = comm.reduce_scatter_to_sp(gathered, group, dim=dim)
        assert summed._base is None and torch.equal(summed, 2 * x), (shape, dim)

    model = tiny_moe().parallelize(DistributedConfig(ep_size=2))
    args = training_args(f"{tmp}/ep", max_steps=2, parallelism_config=ParallelismConfig(ep_size=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(model=model, args=args, train_dataset=tiny_dataset()).train()
    assert not _view_warnings(caught), _view_warnings(caught)


def test_fsdp2_wrapped_experts_return_no_view(tmp_path):
    run_distributed(_no_view_output_worker, 2, str(tmp_path), timeout=300)
