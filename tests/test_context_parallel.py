"""Context parallelism (cp_size) against one process, in fp64: the loss and every gradient of a bare model on a
packed batch longer than the sliding windows, for every family of tests/cp_utils.py, at cp 2, cp 4 and cp 2 x tp 2;
and the errors a user can get."""
from __future__ import annotations

import pytest
import torch

from tests.cp_utils import CP_FAMILIES, SEQ, packed_batch, write_checkpoints
from tests.dist_utils import run_distributed
from tests.helpers import TOL, full_grads
from tptrain import DistributedConfig
from tptrain.distributed import ParallelDims
from tptrain.models import AutoConfig, AutoModelForCausalLM


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_checkpoints(tmp_path_factory.mktemp("cp"))


def _compare_families(paths: dict[str, str], layouts: list[dict]) -> None:
    """Every family at every layout: out.loss, every gradient (gathered over TP) and the local logits equal one
    process's on the same whole batch."""
    import torch.distributed as dist

    from tptrain.distributed import comm
    from tptrain.parallel.context_parallel import local_index

    batch = packed_batch()
    for kwargs in layouts:
        for model_type, path in paths.items():
            what = f"{model_type} {kwargs}"
            ref = AutoModelForCausalLM.from_pretrained(path).train()
            ref_out = ref(**batch)
            ref_out.loss.backward()
            model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(**kwargs)).train()
            tracker = comm.CommTracker()
            with tracker:
                out = model(**batch)
                out.loss.backward()
            torch.testing.assert_close(out.loss, ref_out.loss, **TOL, msg=lambda m: f"{what} loss: {m}")
            grads = full_grads(model)
            for name, p in ref.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m: f"{what} grad {name}: {m}")
            with torch.no_grad():  # eval logits (not fused): this rank's tokens, gathered over TP's vocabulary
                logits, ref_logits = model.eval()(batch["input_ids"]).logits, ref.eval()(batch["input_ids"]).logits
            cp_rank = model.cp_context.rank
            index = local_index(SEQ, kwargs["cp_size"], cp_rank)
            torch.testing.assert_close(logits, ref_logits[:, index], **TOL, msg=lambda m: f"{what} logits: {m}")
            gathers = [r for r in tracker.records if r.op == "all_gather" and r.phase == "forward"]
            assert len(gathers) >= model.config.num_hidden_layers, (what, tracker.records)
    dist.barrier()


def _wrong_length(path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(cp_size=2))
    batch = packed_batch(seq=14)
    with pytest.raises(ValueError, match=r"cp_size=2.*multiple of 4.*pad the batch to 16 tokens"):
        model(**batch)


def _cp2_worker(paths: dict[str, str]) -> None:
    _compare_families(paths, [dict(cp_size=2, tp_size=1)])
    _wrong_length(paths["qwen3"])


def _cp4_worker(paths: dict[str, str]) -> None:
    _compare_families(paths, [dict(cp_size=4, tp_size=1), dict(cp_size=2, tp_size=2)])


@pytest.mark.distributed
def test_cp2_bare_model_equals_one_process(checkpoints):
    run_distributed(_cp2_worker, 2, checkpoints, timeout=600)


@pytest.mark.distributed
def test_cp4_and_cp2_tp2_bare_model_equal_one_process(checkpoints):
    run_distributed(_cp4_worker, 4, checkpoints, timeout=600)


def test_cp_size_is_validated():
    assert DistributedConfig(cp_size=2, tp_size=2).parallel_dims(8) == ParallelDims(1, 2, 2, cp=2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"cp_size must be a positive int"):
            DistributedConfig(cp_size=bad).parallel_dims(4)
    with pytest.raises(ValueError, match=r"cp_size=3 = 3.*world size is 4"):
        DistributedConfig(cp_size=3).parallel_dims(4)
    with pytest.raises(ValueError, match=r"tp_size=2 x dp_replicate_size=1 x cp_size=4 = 8.*world size is 4"):
        DistributedConfig(tp_size=2, cp_size=4).parallel_dims(4)


def test_cp_refuses_device_map_and_the_transformers_backend(checkpoints, monkeypatch):
    with pytest.raises(ValueError, match=r"device_map cannot be combined.*context parallelism"):
        AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"], device_map="cpu",
                                             distributed_config=DistributedConfig(cp_size=2))
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = AutoConfig.from_pretrained(checkpoints["qwen3"], backend="transformers")
    hf = AutoModelForCausalLM.from_config(config, device="meta")
    with pytest.raises(ValueError, match=r"cp_size=2.*model\.layers\.0\.self_attn \(Qwen3Attention and 1 more\).*"
                                         r"backend='native'"):
        hf._check_plan(DistributedConfig(cp_size=2))
    moe = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen3_moe", **{**CP_FAMILIES["qwen3_moe"], "output_router_logits": True}), device="meta")
    with pytest.raises(ValueError, match=r"output_router_logits=True"):
        moe._check_plan(DistributedConfig(cp_size=2))
