"""Phi-3 (fused qkv_proj and gate_up_proj, partial rotary) against transformers 5.23, and its tensor-parallel
layout: `fused_colwise` splits each fused segment (q, k, v; gate, up) on its own, so a rank holds its heads of
q, k and v concatenated, read straight from the fused checkpoint tensor and written back fused.

A tiny random checkpoint written by transformers' Phi3ForCausalLM (2 KV heads, so tp 4 replicates KV;
partial_rotary_factor 0.5), fp64 throughout. One spawned job per world size.

    .venv/bin/python -m pytest tests/test_family_phi3.py -q
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.batches import batch as _batch
from tests.helpers.checkpoints import TransformersCheckpoints
from tests.helpers.compare import assert_trains_like, check_against_hf
from tests.helpers.configs import PHI3_TINY as TINY
from tests.helpers.lora import peft_adapter
from tests.helpers.ranks import run_distributed
from tests.helpers.references import fp64_reference, hf_reference as _hf_reference, reference_losses
from tests.helpers.trainer import tiny_dataset, training_args
from tptrain import AutoModelForCausalLM, DistributedConfig
from tptrain.io import CheckpointReader
from tptrain.diagnostics.accounting import comm_report
from tptrain.diagnostics.plan_report import plan_report
from tptrain.distributed.comm import CommTracker
from tptrain.models import AutoConfig, Phi3Config
from tptrain.parallel.plan import check_plan
from tptrain.parallel.tensor_parallel import gather_full, read_shard

F64 = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)  # fp64: a layout bug is an O(1) error
# transformers' Phi3RMSNorm normalises in fp32 even in an fp64 model (tptrain: in fp64), ~3e-6 apart.
HF_TOL = dict(rtol=1e-5, atol=1e-5)
B, S = 2, 12
FUSED = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")


# (directory written by transformers, its fp64 logits and loss on _batch()): every parameter random, norms around 1
CHECKPOINTS = TransformersCheckpoints({"phi3": ("phi3", TINY)}, reference=fp64_reference)


def _check_against_hf(model, expected, what: str) -> float:
    return check_against_hf(model, expected, what, HF_TOL)


def test_tp1_logits_loss_and_grads_match_transformers(checkpoint):
    import transformers
    path, expected = checkpoint
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
    assert type(model.config) is Phi3Config and model.config.rotary_dim == 8  # half of head_dim 16
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (128, 64)
    _check_against_hf(model, expected, "tp=1")

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F64).eval()
    ids, labels = _batch()
    model(ids, labels=labels).loss.backward()
    hf(ids, labels=labels).loss.backward()
    hf_grads = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, hf_grads[name].grad, **HF_TOL, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_and_bf16_arithmetic_is_transformers(checkpoint, dtype):
    import transformers
    path, _ = checkpoint
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("key, value, match", [
    ("rope_scaling", {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 4}, "short_factor"),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "rope_scaling"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "rope_scaling"),
    ("resid_pdrop", 0.1, "resid_pdrop"), ("attention_dropout", 0.1, "attention_dropout"),
    ("partial_rotary_factor", 0.0, "partial_rotary_factor")])
def test_unsupported_config_values_name_the_key(key, value, match):
    with pytest.raises(ValueError, match=match):
        Phi3Config.from_dict({**TINY, "model_type": "phi3", key: value})


def test_plan_shows_packed_segments_per_rank_and_refuses_plain_colwise():
    config = AutoConfig.for_model("phi3", **TINY)
    report = plan_report(config, 4)
    assert not report.problems, report.text
    rows = [line.split() for line in report.text.splitlines()]
    qkv = next(r for r in rows if r and r[0].endswith("self_attn.qkv_proj"))
    gate_up = next(r for r in rows if r and r[0].endswith("mlp.gate_up_proj"))
    # q 64/4 + k 32/2 + v 32/2 rows per rank (KV replicated over 2 ranks); gate 96/4 + up 96/4
    assert qkv[1:7] == ["fused_colwise", "weight", "(128,", "64)", "(48,", "64)"], qkv
    assert gate_up[1:7] == ["fused_colwise", "weight", "(192,", "64)", "(48,", "64)"], gate_up
    assert "64/4 + 32/2 (each chunk on 2 ranks) + 32/2 (each chunk on 2 ranks)" in report.text, report.text

    model = AutoModelForCausalLM.from_config(config, device="meta")
    spec = check_plan(model, "auto", 4).specs["model.layers.0.self_attn.qkv_proj.weight"]
    assert spec.segments == ((64, 1), (32, 2), (32, 2)) and spec.partial_grad
    problems = check_plan(model, {"layers.*.self_attn.qkv_proj": "colwise"}, 2).problems
    assert any("qkv_proj" in p and "fused_colwise" in p for p in problems), problems



def test_transformers_spelling_packed_colwise_is_the_fused_style():
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("phi3", **TINY), device="meta")
    auto = check_plan(model, "auto", 4)
    old = check_plan(model, {"layers.*.self_attn.qkv_proj": "packed_colwise",
                             "layers.*.mlp.gate_up_proj": "packed_colwise"}, 4)
    assert not old.problems, old.problems
    assert old.styles["model.layers.0.self_attn.qkv_proj"] == "fused_colwise"
    assert old.specs == auto.specs

class _RecordingReader(CheckpointReader):
    """Records the row slices asked of each tensor's memory-mapped file."""

    def __init__(self, directory):
        super().__init__(directory)
        self.requests: list[tuple[str, tuple[int, int]]] = []

    def _handle(self, file):
        handle, reader = super()._handle(file), self

        class Recorder:
            def get_slice(self, name):
                tensor_slice = handle.get_slice(name)

                class Sliced:
                    def __getitem__(self, index):
                        rows = index[0]
                        reader.requests.append((name, (rows.start, rows.stop)))
                        return tensor_slice[index]
                return Sliced()

            def get_tensor(self, name):
                raise AssertionError(f"{name} read whole")
        return Recorder()


@pytest.mark.parametrize("tp", [2, 4])
def test_loader_reads_only_the_ranks_rows_of_each_segment(checkpoint, tp):
    path, _ = checkpoint
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), device="meta")
    specs = check_plan(model, "auto", tp).specs
    full = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    for rank in range(tp):
        reader = _RecordingReader(path)
        got = read_shard(reader, name, specs[name], tp_size=tp, tp_rank=rank, dtype=torch.float32)
        q, kv = 64 // tp, 32 // min(tp, 2)  # KV heads: 2 chunks at tp 4, each on 2 ranks
        kv_start = 64 + (rank // max(tp // 2, 1)) * kv
        expected = [(rank * q, rank * q + q), (kv_start, kv_start + kv), (32 + kv_start, 32 + kv_start + kv)]
        assert reader.requests == [(name, r) for r in expected], reader.requests
        rows = torch.cat([full[name][a:b] for a, b in expected])
        torch.testing.assert_close(got, rows, rtol=0, atol=0)
        assert got.shape == (q + 2 * kv, 64)
        name_mlp = "model.layers.0.mlp.gate_up_proj.weight"
        reader.requests.clear()
        read_shard(reader, name_mlp, specs[name_mlp], tp_size=tp, tp_rank=rank)
        inner = 96 // tp
        assert reader.requests == [(name_mlp, (rank * inner, rank * inner + inner)),
                                   (name_mlp, (96 + rank * inner, 96 + rank * inner + inner))]


def _equivalence(model, ref, *, steps: int = 3) -> float:
    """Logits, gradients of every parameter and 3 AdamW steps of the TP `model` equal the single-device `ref`;
    returns max |logits - single-device logits|."""
    return assert_trains_like(model, ref, *_batch(seed=2), steps=steps, tol=TOL)


def _assert_communication(model, tp: int) -> str:
    """One training forward + backward sends exactly the Megatron minimum: the fused projections need no
    collective of their own (one input boundary per block, one all-reduce per row-parallel output)."""
    ids, labels = _batch()
    layers, tokens = TINY["num_hidden_layers"], B * S
    act = tokens * TINY["hidden_size"] * 8  # one fp64 (batch, seq, hidden) activation
    with CommTracker() as t:
        model(ids, labels=labels).loss.backward()
    fwd = sorted(r.bytes for r in t.records if r.phase == "forward")
    bwd = sorted(r.bytes for r in t.records if r.phase == "backward")
    assert {r.op for r in t.records} == {"all_reduce"}, t.records
    # + the vocab-parallel loss fused with the head (issue 24): per chunk (one here) the max, [target, sum-exp]
    assert fwd == sorted([act] * (2 * layers + 1) + [tokens * 8, 2 * tokens * 8]), fwd
    assert bwd == sorted([act] * (2 * layers + 1)), bwd  # + the head's input boundary
    partial = tp > TINY["num_key_value_heads"]  # only the replicated KV segments of qkv_proj hold shares
    assert t.counts("grad_sync") == ({"all_reduce": 1} if partial else {})
    model.zero_grad()
    report = comm_report(model, ids, labels)
    assert report.matches_minimum and report.full_logit_collectives == 0, report.table()
    model.zero_grad()
    return report.table()


LORA_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
LORA_TOL = dict(rtol=1e-5, atol=1e-5)  # the bases differ by transformers' fp32 RMSNorm (~3e-6)


def _lora_crossing(path, tp, peft_dir, adapter_dir) -> dict[str, torch.Tensor]:
    """peft's adapter on a TP base (B read per packed segment), and a tptrain-trained adapter (2 AdamW steps,
    gradients equal to single-device tptrain) saved for peft (B gathered back fused)."""
    from tptrain.peft import PeftModel
    config = DistributedConfig(tp_size=tp)
    ids = _batch()[0]
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=F64,
                                                                            distributed_config=config), peft_dir)
    with torch.no_grad():
        peft_logits = loaded(ids).logits
    # Train peft's adapter at tp and on one device: the same gradients.
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=config),
                                      peft_dir, is_trainable=True)
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=F64), peft_dir, is_trainable=True)
    layout = model.get_base_model().parallel.tp
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_ids, labels = _batch(seed=4)
    for step in range(2):
        model(train_ids, labels=labels).loss.backward()
        if step == 0:
            ref(train_ids, labels=labels).loss.backward()
            grads = {n: p.grad for n, p in ref.get_base_model().named_parameters() if ".lora_" in n}
            for n, p in model.get_base_model().named_parameters():
                if ".lora_" in n:
                    got = gather_full(p.grad, layout.specs[n], layout.ctx)
                    torch.testing.assert_close(got, grads[n], **TOL, msg=lambda m: f"LoRA grad of {n}: {m}")
        opt.step(), opt.zero_grad()
    model.save_pretrained(adapter_dir)
    model.eval()
    with torch.no_grad():
        return {"peft_adapter": peft_logits, "tptrain_adapter": model(ids).logits}


def _trainer_resume(path, tp: int, tmp) -> list[float]:
    """Trainer at tp: 4 steps (clipped gradient norm) equal single-device training, and resuming from the DCP
    checkpoint of step 2 (the packed tensors saved from each rank's boxes, read whole and cut on load)
    gives the same losses."""
    from tptrain.training.args import ParallelismConfig
    from tptrain.training.trainer import Trainer

    def run(out, **kw):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(tp_size=tp))
        args = training_args(out, max_steps=4, save_steps=2, parallelism_config=ParallelismConfig(tp), **kw)
        return Trainer(model=model, args=args, train_dataset=tiny_dataset()).train()

    full = run(f"{tmp}/a")
    resumed = run(f"{tmp}/b", resume_from_checkpoint=f"{tmp}/a/checkpoint-2")
    assert resumed.global_step == 4 and resumed.losses == full.losses[2:], (resumed.losses, full.losses)
    expected = reference_losses(AutoModelForCausalLM.from_pretrained(path, dtype=F64), tiny_dataset(),
                                training_args(f"{tmp}/ref", max_steps=4), global_batch=4)
    torch.testing.assert_close(torch.tensor(full.losses), torch.tensor(expected), **TOL)
    return full.losses


def _worker(path, expected, tp, save_dir, out, peft_dir, adapter_dir) -> None:
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=F64)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(tp_size=tp))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    kv = 32 // min(tp, 2)
    assert attn.qkv_proj.segment_sizes == (64 // tp, kv, kv) and attn.qkv_proj.weight.shape == (64 // tp + 2 * kv, 64)
    assert mlp.gate_up_proj.segment_sizes == (96 // tp, 96 // tp)
    diff = _check_against_hf(model, expected, f"tp={tp}")
    model.save_pretrained(save_dir)  # before any training: must equal the original checkpoint
    table = _assert_communication(model, tp)
    vs_tp1 = _equivalence(model, ref)
    if tp == 2:  # sequence parallelism: the packed projections enter through the same all-gather boundary
        sp = copy.deepcopy(ref).parallelize(DistributedConfig(tp_size=2, enable_sequence_parallel=True))
        _equivalence(sp, copy.deepcopy(ref), steps=1)
        report = comm_report(sp, *_batch())
        assert report.matches_minimum, report.table()
    lora = _lora_crossing(path, tp, peft_dir, adapter_dir)
    _trainer_resume(path, tp, save_dir.parent / "trainer")
    if torch.distributed.get_rank() == 0:
        torch.save({"diff": diff, "vs_tp1": vs_tp1, "table": table, **lora}, out)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_transformers_and_single_device_and_saves_fused_tensors_exactly(checkpoint, tmp_path, tp):
    import transformers
    path, expected = checkpoint
    peft_logits = peft_adapter(path, tmp_path / "peft_adapter", LORA_TARGETS)
    run_distributed(_worker, tp, path, expected, tp, tmp_path / "saved", tmp_path / "out.pt",
                    tmp_path / "peft_adapter", tmp_path / "tptrain_adapter")
    result = torch.load(tmp_path / "out.pt")
    print(f"\ntp={tp} max |logits - transformers| = {result['diff']:.3g}, - tp 1: {result['vs_tp1']:.3g}\n"
          f"{result['table']}")
    original, saved = load_file(path / "model.safetensors"), load_file(tmp_path / "saved" / "model.safetensors")
    assert saved.keys() == original.keys()
    for name, t in original.items():  # bit-identical, the fused tensors included
        assert saved[name].dtype == F64 and torch.equal(saved[name].to(t.dtype), t), name
    assert sum(name.endswith(FUSED) for name in saved) == 2 * TINY["num_hidden_layers"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=F64).eval()
    got = _hf_reference(hf)
    torch.testing.assert_close(got["logits"], expected["logits"], rtol=0, atol=0)
    torch.testing.assert_close(got["loss"], expected["loss"], rtol=0, atol=0)
    # LoRA on the fused projections crosses both ways: peft's adapter on the TP model, the tptrain-trained one in peft.
    import peft
    torch.testing.assert_close(result["peft_adapter"], peft_logits, **LORA_TOL)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F64).eval()
    with torch.no_grad():
        plain = base(_batch()[0]).logits
        reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "tptrain_adapter")(_batch()[0]).logits
    torch.testing.assert_close(reloaded, result["tptrain_adapter"], **LORA_TOL)
    assert (result["tptrain_adapter"] - peft_logits).abs().max() > 1e-2 and (peft_logits - plain).abs().max() > 1e-2


def test_sliding_window_matches_transformers(tmp_path):
    import transformers
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(**TINY, sliding_window=5)).eval()
    hf.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.config.layer_sliding_windows == [5, 5]
    ids, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, rtol=0, atol=0)


def test_longrope_matches_transformers_short_and_long(tmp_path):
    """longrope: short factors up to original_max_position_embeddings, long factors (for the whole sequence) past
    it, cos/sin scaled by sqrt(1 + log(factor) / log(original)); bit for bit in fp32, and in fp64 within HF_TOL."""
    import transformers
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0]}
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **{**TINY, "max_position_embeddings": 64}, original_max_position_embeddings=8, rope_parameters=rope)).eval()
    hf.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.config.rope_type == "longrope" and model.model.rotary_emb.attention_factor > 1.0
    ids, _ = _batch()
    with torch.no_grad():
        for seq in (8, 12):  # up to the original context (short factors), and past it (long factors)
            torch.testing.assert_close(model(ids[:, :seq]).logits, hf(ids[:, :seq]).logits, rtol=0, atol=0)
        short, long = model(ids[:, :8]).logits, model(ids).logits[:, :8]
    assert (short - long).abs().max() > 1e-3  # the long factors change even the first positions
    model.save_pretrained(tmp_path / "saved")  # config.json written back so that transformers reads longrope
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=0, atol=0)
