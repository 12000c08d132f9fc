"""Context parallelism (cp_size) against one process, in fp64: the loss and every gradient of a bare model on a
packed batch longer than the sliding windows, for every family of helpers/configs.py, at cp 2, cp 4 and cp 2 x tp 2
(DeepSeek-V3's latent attention, whose values are narrower than its keys, also 3 AdamW steps at cp 2 and cp 2 x tp 2);
the bytes each rank keeps for backward, at most 1/cp of one process's; and the errors a user can get."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.batches import PACKED_SEQ as SEQ, packed_batch
from tests.helpers.checkpoints import PerturbedCheckpoints
from tests.helpers.compare import TOL, full_grads
from tests.helpers.configs import CP_FAMILIES, F64, SOFTCAP
from tests.helpers.ranks import run_distributed
from tests.helpers.trainer import tiny_model
from tptrain import DistributedConfig
from tptrain.distributed import ParallelDims
from tptrain.models import AutoConfig, AutoModelForCausalLM
from tptrain.training.args import ParallelismConfig
from tptrain.training.mesh import resolve_parallelism


# {model_type: directory} of a seeded fp64 checkpoint of every family (tptrain's save_pretrained, HF format)
CHECKPOINTS = PerturbedCheckpoints({t: (t, kw) for t, kw in {**CP_FAMILIES, **SOFTCAP}.items()})


def _compare_families(paths: dict[str, str], layouts: list[dict]) -> None:
    """Every family at every layout (a layout's "families": only those): out.loss, every gradient (gathered over TP)
    and the local logits equal one process's on the same whole batch."""
    import torch.distributed as dist

    from tptrain.diagnostics.accounting import comm_report
    from tptrain.distributed import comm
    from tptrain.parallel.context_parallel import local_index

    for kwargs in layouts:
        kwargs = dict(kwargs)
        families = kwargs.pop("families", list(CP_FAMILIES))
        batch = packed_batch(packed=kwargs.pop("packed", True))
        for model_type, path in ((t, paths[t]) for t in families):
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
                if p.requires_grad:  # not DeepSeek's frozen e_score_correction_bias
                    torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m: f"{what} grad {name}: {m}")
            with torch.no_grad():  # eval logits (not fused): this rank's tokens, gathered over TP's vocabulary
                logits, ref_logits = model.eval()(batch["input_ids"]).logits, ref.eval()(batch["input_ids"]).logits
            cp_rank = model.parallel.cp.rank
            index = local_index(SEQ, kwargs["cp_size"], cp_rank)
            torch.testing.assert_close(logits, ref_logits[:, index], **TOL, msg=lambda m: f"{what} logits: {m}")
            gathers = [r for r in tracker.records if r.op == "all_gather" and r.phase == "forward"]
            assert len(gathers) >= model.config.num_hidden_layers, (what, tracker.records)
            if model_type in ("qwen3", "phi3", "deepseek_v3") and "position_ids" in batch:  # cp's, TP's at minimum
                model.train().zero_grad()
                report = comm_report(model, batch["input_ids"], batch["labels"], position_ids=batch["position_ids"])
                assert report.matches_minimum, f"{what}\n{report.table()}"
    dist.barrier()


def _adamw_steps(path: str, steps: int = 3, **kwargs) -> None:
    """`steps` AdamW steps on one packed batch: each step's loss and then every parameter (gathered over TP) equal
    one process's."""
    from tests.helpers.compare import full_params

    batch = packed_batch(seed=1)
    ref = AutoModelForCausalLM.from_pretrained(path).train()
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(**kwargs)).train()
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        ref_loss, loss = ref(**batch).loss, model(**batch).loss
        torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{kwargs} loss, step {step}: {m}")
        ref_loss.backward(), loss.backward()
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    params = full_params(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), **TOL, msg=lambda m: f"{kwargs} {name} after {steps} "
                                                                                  f"AdamW steps: {m}")


def _saved_bytes(model, batch: dict) -> tuple[int, int]:
    """(bytes the forward keeps for backward, of them the first decoder layer's): SavedTensorMeter, parameters
    excluded (only the innermost saved-tensor hooks run: the layer's meter sees what the outer one does not)."""
    from tptrain.diagnostics.accounting import SavedTensorMeter

    layer, meters = model.model.layers[0], []

    def enter(*_):
        meters.append(SavedTensorMeter(model.parameters()).__enter__())

    hooks = [layer.register_forward_pre_hook(enter), layer.register_forward_hook(lambda *_: meters[-1].__exit__())]
    with SavedTensorMeter(model.parameters()) as meter:
        loss = model(**batch).loss
    for hook in hooks:
        hook.remove()
    loss.backward()  # the re-gathers: every rank runs the backward it set up
    return meter.bytes + meters[0].bytes, meters[0].bytes


def _keeps_a_share(paths: dict[str, str], cp: int) -> None:
    """Each cp rank keeps for backward at most 1/cp of what one process keeps, per layer and in all: K and V are
    gathered again in backward, not kept. Packed rows (masks, a sliding window) and plain causal ones (each chunk
    against its prefix), grouped-query and latent attention (values narrower than keys)."""
    for model_type, packed in (("qwen3", True), ("qwen3", False), ("mistral", True), ("deepseek_v3", False)):
        batch = packed_batch(packed=packed, seq=64)
        one = _saved_bytes(AutoModelForCausalLM.from_pretrained(paths[model_type]).train(), batch)
        model = AutoModelForCausalLM.from_pretrained(paths[model_type], distributed_config=DistributedConfig(
            cp_size=cp, tp_size=1)).train()
        kept = _saved_bytes(model, batch)
        assert all(k <= o / cp for k, o in zip(kept, one)), (model_type, packed, cp, "kept (all, layer 0)", kept,
                                                             "one process's", one)


def _wrong_length(path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(cp_size=2))
    batch = packed_batch(seq=14)
    with pytest.raises(ValueError, match=r"cp_size=2.*multiple of 4.*pad the batch to 16 tokens"):
        model(**batch)


def _cp4_worker(paths: dict[str, str], tmp: str) -> None:
    _compare_families(paths, [dict(cp_size=4, tp_size=1), dict(cp_size=2, tp_size=2),
                              dict(cp_size=2, tp_size=2, enable_sequence_parallel=True, families=["qwen3", "olmo2"]),
                              dict(cp_size=4, tp_size=1, packed=False, families=["qwen3", "gemma2"]),
                              dict(cp_size=2, tp_size=2, packed=False, families=["phi3", "gemma2"])])
    _adamw_steps(paths["deepseek_v3"], cp_size=2, tp_size=2)
    _keeps_a_share(paths, 4)
    _trainer_with_tp(tmp)


def _trainer_with_tp(tmp: str) -> None:
    """The Trainer at cp 2 x tp 2 (FSDP2 over dp_shard x cp of 1 x 2) equals one process; its checkpoint resumes at
    cp 1 x tp 2 (dp_shard 2)."""
    import copy

    from tests.helpers.references import reference_losses
    from tests.helpers.trainer import tiny_dataset

    ref = tiny_model()
    trainer = _trainer(copy.deepcopy(ref).parallelize(DistributedConfig(cp_size=2, tp_size=2)), f"{tmp}/tp2", 2,
                       save_steps=2)
    out = trainer.train()
    expected = reference_losses(ref, tiny_dataset(), trainer.args, global_batch=4)
    torch.testing.assert_close(torch.tensor(out.losses), torch.tensor(expected), rtol=1e-9, atol=1e-9)
    resumed = _trainer(tiny_model().parallelize(DistributedConfig(tp_size=2)), f"{tmp}/tp2cp1", 1, batch=2).train(
        resume_from_checkpoint=f"{tmp}/tp2/checkpoint-2")
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(out.losses[2:]), rtol=1e-9, atol=1e-9)


@pytest.mark.distributed
def test_cp4_and_cp2_tp2_equal_one_process(checkpoints, tmp_path):
    run_distributed(_cp4_worker, 4, checkpoints, str(tmp_path), timeout=600)


def test_cp_size_is_validated():
    assert DistributedConfig(cp_size=2, tp_size=2).parallel_dims(8) == ParallelDims(1, 2, 2, cp=2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"cp_size must be a positive int"):
            DistributedConfig(cp_size=bad).parallel_dims(4)
    with pytest.raises(ValueError, match=r"cp_size=3 = 3.*world size is 4"):
        DistributedConfig(cp_size=3).parallel_dims(4)
    with pytest.raises(ValueError, match=r"tp_size=2 x dp_replicate_size=1 x cp_size=4 = 8.*world size is 4"):
        DistributedConfig(tp_size=2, cp_size=4).parallel_dims(4)
    # ep folded over dp_shard x cp (tests/test_compose_moe.py); an ep group holds whole cp groups
    assert DistributedConfig(cp_size=2, ep_size=2, tp_size=1).parallel_dims(4) == ParallelDims(1, 2, 1, ep=2, cp=2)
    with pytest.raises(ValueError, match=r"ep_size=3 \(--ep-size\) is not a multiple of cp_size=2"):
        DistributedConfig(cp_size=2, ep_size=3, tp_size=1).parallel_dims(6)
    # the Trainer's spelling (accelerate's): checked against the model, whose cp_size is set when it is loaded
    assert ParallelismConfig(cp_size=2, tp_size=1).parallel_dims(4) == ParallelDims(1, 2, 1, cp=2)
    with pytest.raises(ValueError, match=r"ParallelismConfig\(cp_size=2\) disagrees with the model.*cp_size=1"):
        resolve_parallelism(tiny_model(), ParallelismConfig(cp_size=2), world_size=2)


def test_cp_refuses_device_map_and_passes_the_plan_check(checkpoints, monkeypatch):
    with pytest.raises(ValueError, match=r"device_map cannot be combined.*context parallelism"):
        AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"], device_map="cpu",
                                             distributed_config=DistributedConfig(cp_size=2))
    import tptrain.distributed

    # A world of 2 whatever this pytest process holds (an earlier test may have left a 1-rank group initialised).
    monkeypatch.setattr(tptrain.distributed, "env_world_size", lambda: 2)
    config = AutoConfig.from_pretrained(checkpoints["qwen3"], backend="transformers")
    hf = AutoModelForCausalLM.from_config(config, device="meta")
    hf._check_plan(DistributedConfig(cp_size=2))  # the backend runs cp too (tests/test_hf_context_parallel.py)
    # the router aux loss and longrope compose with cp (tests/test_compose_moe.py): the plan check passes
    moe = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen3_moe", **{**CP_FAMILIES["qwen3_moe"], "output_router_logits": True}), device="meta")
    moe._check_plan(DistributedConfig(cp_size=2))
    longrope = dict(rope_type="longrope", short_factor=[1.0, 1.5], long_factor=[2.0, 3.0],
                    original_max_position_embeddings=16)
    phi = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "phi3", **{**CP_FAMILIES["phi3"], "rope_scaling": longrope}), device="meta")
    phi._check_plan(DistributedConfig(cp_size=2))


def test_plan_states_mla_keys_and_narrower_values_per_token():
    """`tptrain plan --cp-size 2` on DeepSeek-V3: no problem, and K/V bytes per token of each head's key (8 + 8) and
    narrower value (12), 2 heads per rank at tp 2, fp32."""
    from tptrain.diagnostics.plan_report import plan_report

    config = type(AutoConfig.for_model("deepseek_v3")).from_dict({"model_type": "deepseek_v3", **CP_FAMILIES[
        "deepseek_v3"]})
    report = plan_report(config, 2, cp_size=2, dtype="float32")
    assert not report.problems, report.problems
    assert f"{2 * (8 + 8 + 12) * 4} bytes per token" in report.text, report.text


# ------------------------------------------------------------------ the Trainer at cp 2 against one process

def _trainer(model, out_dir, cp: int, batch: int = 4, eval_dataset=None, **kw):
    from tests.helpers.trainer import tiny_dataset, training_args
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    args = training_args(out_dir, per_device_train_batch_size=batch, parallelism_config=ParallelismConfig(
        cp_size=cp), **{"max_steps": 3, **kw})
    return Trainer(model=model, args=args, train_dataset=tiny_dataset(), eval_dataset=eval_dataset)


def _lora_pair(tmp: str, base):
    """(one-process LoRA model, its cp-2 copy): q/k/v/o adapters, B not zero, so every factor has a gradient."""
    import copy

    import torch.distributed as dist

    from tptrain.peft import LoraConfig, PeftModel, get_peft_model

    single = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj",
                                                                                                 "v_proj", "o_proj"]))
    with torch.no_grad():
        for name, p in single.named_parameters():
            if ".lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype) * 0.1)
    if dist.get_rank() == 0:
        single.save_pretrained(f"{tmp}/adapter")
    dist.barrier()
    model = copy.deepcopy(base).parallelize(DistributedConfig(cp_size=2))
    return single, PeftModel.from_pretrained(model, f"{tmp}/adapter", is_trainable=True)


def _cp2_worker(paths: dict[str, str], tmp: str) -> None:
    """One group of 2 ranks: the bare model of every family at cp 2, a length that does not split, the Trainer."""
    _compare_families(paths, [dict(cp_size=2, tp_size=1), dict(cp_size=2, tp_size=1, packed=False,
                                                                families=["qwen3", "gemma2", "qwen3_moe"])])
    _wrong_length(paths["qwen3"])
    _adamw_steps(paths["deepseek_v3"], cp_size=2, tp_size=1)
    _keeps_a_share(paths, 2)
    _trainer_worker(tmp)


def _trainer_worker(tmp: str) -> None:
    """4 AdamW steps (losses and parameters) and eval_loss at cp 2 equal one process; so do activation
    checkpointing and LoRA; a checkpoint saved at cp 2 resumes at cp 1 (dp 2) and one saved at cp 1 at cp 2."""
    import copy

    from tests.helpers.references import reference_losses
    from tests.helpers.trainer import tiny_dataset, tiny_model
    from tptrain.distributed import comm, init_distributed
    from tptrain.parallel.saving import gather_parameters

    init_distributed()
    close = dict(rtol=1e-9, atol=1e-9)
    held_out = tiny_dataset(6, seed=5)
    ref = tiny_model()
    trainer = _trainer(copy.deepcopy(ref).parallelize(DistributedConfig(cp_size=2)), f"{tmp}/cp2", 2,
                       eval_dataset=held_out, max_steps=4, save_steps=2)
    tracker = comm.CommTracker()
    with tracker:
        out = trainer.train()
    kv_gathers = [r for r in tracker.records if r.op == "all_gather" and r.shape[-1] == 2 * 8]  # K and V side by side
    assert len(kv_gathers) >= 4 * 2 and {r.ranks for r in kv_gathers} == {2}, tracker.records
    expected = reference_losses(ref, tiny_dataset(), trainer.args, global_batch=4)
    torch.testing.assert_close(torch.tensor(out.losses), torch.tensor(expected), **close)
    params = gather_parameters(trainer.model, [n for n, _ in trainer.model.named_parameters()])
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), **close, msg=lambda m: f"{name} after 4 steps: {m}")
    with torch.no_grad():
        ref_eval = ref.eval()(torch.stack(list(held_out)), labels=torch.stack(list(held_out))).loss.item()
    assert abs(trainer.evaluate()["eval_loss"] - ref_eval) < 1e-9, (trainer.evaluate(), ref_eval)

    # resume across cp sizes: cp 2 -> cp 1 (dp_shard 2, 2 rows each), which saves at step 3 -> cp 2 again
    at_cp1 = _trainer(tiny_model(), f"{tmp}/cp1", 1, batch=2, max_steps=4, save_steps=1).train(
        resume_from_checkpoint=f"{tmp}/cp2/checkpoint-2")
    torch.testing.assert_close(torch.tensor(at_cp1.losses), torch.tensor(out.losses[2:]), **close)
    back = _trainer(tiny_model().parallelize(DistributedConfig(cp_size=2)), f"{tmp}/back", 2, max_steps=4).train(
        resume_from_checkpoint=f"{tmp}/cp1/checkpoint-3")
    torch.testing.assert_close(torch.tensor(back.losses), torch.tensor(out.losses[3:]), **close)

    ac = _trainer(tiny_model().parallelize(DistributedConfig(cp_size=2)), f"{tmp}/ac", 2,
                  gradient_checkpointing=True).train()
    torch.testing.assert_close(torch.tensor(ac.losses),
                               torch.tensor(reference_losses(tiny_model(), tiny_dataset(), ac_args(tmp), 4)), **close)

    # fused q/k/v and gate/up (Phi-3): the clip's and the checkpoint's view of FSDP's pieces over dp_shard x cp
    torch.manual_seed(0)
    phi_config = AutoConfig.for_model("phi3", **{**CP_FAMILIES["phi3"], "vocab_size": 128})
    phi = AutoModelForCausalLM.from_config(phi_config, dtype=F64)
    fused = _trainer(copy.deepcopy(phi).parallelize(DistributedConfig(cp_size=2)), f"{tmp}/phi", 2, save_steps=2)
    fused_out = fused.train()
    torch.testing.assert_close(torch.tensor(fused_out.losses),
                               torch.tensor(reference_losses(phi, tiny_dataset(), fused.args, 4)), **close)
    phi_cp1 = AutoModelForCausalLM.from_config(phi_config, dtype=F64)
    resumed = _trainer(phi_cp1, f"{tmp}/phi1", 1, batch=2).train(resume_from_checkpoint=f"{tmp}/phi/checkpoint-2")
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(fused_out.losses[2:]), **close)

    single, lora = _lora_pair(tmp, tiny_model())
    lora_out = _trainer(lora, f"{tmp}/lora", 2).train()
    torch.testing.assert_close(torch.tensor(lora_out.losses),
                               torch.tensor(reference_losses(single, tiny_dataset(), ac_args(tmp), 4)), **close)


def ac_args(tmp: str):
    """The arguments of the 3-step runs, for their one-process reference."""
    from tests.helpers.trainer import training_args

    return training_args(f"{tmp}/ref", max_steps=3)


@pytest.mark.distributed
def test_cp2_bare_model_and_trainer_equal_one_process(checkpoints, tmp_path):
    run_distributed(_cp2_worker, 2, checkpoints, str(tmp_path), timeout=600)


# ------------------------------------------------------------------ the CLI


@pytest.mark.distributed
def test_cli_fine_tunes_and_plans_at_cp2(tmp_path, capsys):
    """`tptrain train --cp-size 2` on chat records with LoRA and eval (random init from config.json), its greedy
    sample included; `tptrain plan --cp-size 2`; a --seq-len that does not split, refused before any worker."""
    import json

    from tests.helpers.chat import BUNDLED, CHATML_GENERATION, chat_checkpoint, chat_records
    from tests.helpers.launch import tptrain_train
    from tptrain.cli import main
    from tptrain.training.reporting import read_metrics

    config = {**json.loads((BUNDLED / "config.json").read_text()), "vocab_size": 4160, "hidden_size": 32,
              "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 8}
    ckpt = chat_checkpoint(tmp_path / "ckpt", CHATML_GENERATION, config=config)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_records(12, 1)))
    flags = ("--model", str(ckpt), "--data", str(data), "--eval-data", str(data), "--tp-size", "1", "--cp-size", "2",
             "--batch-size", "2", "--max-steps", "2", "--lora-r", "4", "--max-new-tokens", "2", "--prompt", "to be")
    run = tptrain_train(*flags, "--seq-len", "64", "--output-dir", str(tmp_path / "run"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "cp 2" in run.stdout and "greedy continuation" in run.stdout, run.stdout
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1, 2] and any("eval_loss" in r for r in records)
    capsys.readouterr()
    assert main(["train", "--smoke-test", *flags, "--seq-len", "30", "--output-dir", str(tmp_path / "bad")]) == 2
    assert "--seq-len is 30, not a multiple of 4" in capsys.readouterr().err
    assert main(["plan", str(ckpt), "--tp-size", "1", "--cp-size", "2"]) == 0
    assert "context parallelism: cp_size=2" in capsys.readouterr().out
