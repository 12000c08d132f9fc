"""transformers' load-time conversions on the transformers backend (tptrain/hf/conversions.py): checkpoints written
by transformers itself in the hub's layout (gpt_neox's `embed_out`, hrm_text's fused `gqkv_proj` / `gate_up_proj`
cut by Chunk, glm4_moe's per-expert tensors merged by MergeModulelist + Concatenate), loaded slice by slice, equal to
transformers on one process (logits, gradients, 3 AdamW steps at tp 2 and 4), saved back bit for bit.

    .venv/bin/python -m pytest tests/test_hf_conversions.py -q
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers.batches import batch
from tests.helpers.checkpoints import TransformersCheckpoints
from tests.helpers.compare import check_against_hf, full_params
from tests.helpers.ranks import run_distributed
from tests.helpers.references import fp64_reference
from tptrain.io import CheckpointReader
from tptrain.parallel.styles import ShardSpec
from tptrain.parallel.tensor_parallel import gather_full

F64 = torch.float64
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, head_dim=8, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
ARCHS = {
    "gpt_neox": dict(rotary_pct=0.5),  # embed_out -> lm_head (every Pythia checkpoint)
    "hrm_text": dict(H_cycles=1, L_cycles=1, num_layers_per_stack=1),  # Chunk: fused gqkv / gate_up cut in 4 / 2
}
MOE = dict(TINY, num_key_value_heads=2, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
           n_shared_experts=1, first_k_dense_replace=0)
TOL = dict(rtol=1e-6, atol=1e-6)  # transformers' norms compute in fp32 in an fp64 model; a layout bug is O(1)
STEP_TOL = dict(rtol=1e-5, atol=1e-5)


# {model_type: (a random transformers model saved by transformers (the hub layout), its fp64 reference on batch())}
CHECKPOINTS = TransformersCheckpoints({t: (t, dict(TINY, **extra)) for t, extra in ARCHS.items()},
                                      reference=fp64_reference)
MOE_CHECKPOINT = TransformersCheckpoints({"glm4_moe": ("glm4_moe", MOE)}, reference=fp64_reference)


def _stored(path) -> dict[str, torch.Tensor]:
    with CheckpointReader(path) as reader:
        return {k: reader.read(k) for k in reader.keys()}


def _assert_same_files(saved, original, what: str, dtype: torch.dtype = torch.float32) -> None:
    """The same tensor names (the hub's) and shapes, the same values bit for bit (saved in `dtype`, the original
    fp32: every fp32 value is exact in fp64)."""
    a, b = _stored(saved), _stored(original)
    assert sorted(a) == sorted(b), (what, sorted(set(a) ^ set(b))[:5])
    for k in b:
        assert a[k].dtype == dtype and torch.equal(a[k], b[k].to(dtype)), (what, k)


def _train_like(model, ref, steps: int = 3) -> None:
    """Gradients of the first step and the parameters after `steps` AdamW steps equal the one-process `ref`."""
    ids, labels = batch(seed=2)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for step in range(steps):
        ref_loss, loss = ref(ids, labels=labels).loss, model(ids, labels=labels).loss
        torch.testing.assert_close(loss, ref_loss, **TOL)
        ref_loss.backward(), loss.backward()
        if step == 0:
            grads = {n: p.grad for n, p in ref.named_parameters()}
            layout = model.parallel.tp
            for n, p in model.named_parameters():
                torch.testing.assert_close(gather_full(p.grad, layout.specs[n], layout.ctx), grads[n], **TOL,
                                           msg=lambda m: f"grad of {n}: {m}")
        for opt in opts:
            opt.step(), opt.zero_grad()
    params = full_params(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), **STEP_TOL, msg=lambda m: f"{name} after {steps}: {m}")


def _tp_worker(tp: int, checkpoints: dict, save_root) -> None:
    from tptrain import DistributedConfig
    from tptrain.hf.model import TransformersCausalLM
    for model_type, (path, expected) in checkpoints.items():
        ref = TransformersCausalLM.from_pretrained(path, dtype=F64)
        model = TransformersCausalLM.from_pretrained(path, dtype=F64, distributed_config=DistributedConfig(tp_size=tp))
        assert model.checkpoint_keys(), model_type  # the conversions were applied, not skipped
        check_against_hf(ref, expected, f"{model_type} tp=1", TOL)
        check_against_hf(model, expected, f"{model_type} tp={tp}", TOL)
        model.save_pretrained(save_root / model_type)
        _train_like(model, ref)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_converted_checkpoints_match_transformers_at_tp_and_save_the_hub_layout(checkpoints, tmp_path, tp):
    import transformers
    run_distributed(_tp_worker, tp, tp, checkpoints, tmp_path, timeout=600)
    for model_type, (path, expected) in checkpoints.items():
        _assert_same_files(tmp_path / model_type, path, f"{model_type} saved at tp {tp}", F64)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / model_type, dtype=F64)
        with torch.no_grad():
            torch.testing.assert_close(reloaded(batch()[0]).logits, expected["logits"], rtol=0, atol=0)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return MOE_CHECKPOINT.write(tmp_path_factory)["glm4_moe"]


def test_merged_experts_load_train_and_save_like_transformers(moe_checkpoint, tmp_path):
    """glm4_moe's per-expert tensors merged into gate_up_proj / down_proj: transformers' logits and gradients; the
    save writes the per-expert tensors back, bit for bit."""
    import transformers

    from tptrain.hf.model import TransformersCausalLM
    path, expected = moe_checkpoint
    model = TransformersCausalLM.from_pretrained(path, dtype=F64)
    model.hf_model.set_experts_implementation("eager")
    keys = model.checkpoint_keys()
    assert "MergeModulelist" in keys["model.layers.0.mlp.experts.gate_up_proj"].rule
    check_against_hf(model, expected, "glm4_moe", TOL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=F64, experts_implementation="eager")
    ids, labels = batch()
    model(ids, labels=labels).loss.backward()
    hf(ids, labels=labels).loss.backward()
    hf_params = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, hf_params[name].grad, **TOL, msg=lambda m: f"{name}: {m}")
    TransformersCausalLM.from_pretrained(path).save_pretrained(tmp_path / "saved")  # in the checkpoint's dtype
    _assert_same_files(tmp_path / "saved", path, "glm4_moe")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=F64,
                                                                 experts_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected["logits"], rtol=0, atol=0)


class _CountingReader(CheckpointReader):
    """Records every tensor read and the bytes copied out of the files."""

    def __init__(self, directory) -> None:
        super().__init__(directory)
        self.reads: list[tuple[str, int]] = []

    def read(self, name, **kwargs):
        out = super().read(name, **kwargs)
        self.reads.append((name, out.numel() * out.element_size()))
        return out

    def read_ranges(self, name, **kwargs):
        out = super().read_ranges(name, **kwargs)
        self.reads.append((name, out.numel() * out.element_size()))
        return out


def test_merged_experts_read_only_this_ranks_experts_and_rows(moe_checkpoint):
    """Each (ep rank, tp rank) reads exactly its piece of a merged expert stack: only its experts' tensors, only
    its rows of each, no byte more; equal to the same piece of the stack transformers builds."""
    import transformers

    from tptrain.hf.conversions import checkpoint_sources
    from tptrain.hf.model import TransformersCausalLM
    path, _ = moe_checkpoint
    full = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    meta = TransformersCausalLM.from_config(transformers.AutoConfig.from_pretrained(path), device="meta")
    reader = _CountingReader(path)
    sources = checkpoint_sources(meta.hf_model, reader)
    inner = MOE["moe_intermediate_size"]
    fused = ShardSpec(1, segments=((inner, 1), (inner, 1)))  # gate and up rows, each split alone
    layouts = [("gate_up_proj", fused, 2, 1), ("gate_up_proj", ShardSpec(0), 2, 1), ("down_proj", ShardSpec(2), 2, 1),
               ("gate_up_proj", ShardSpec(1, segments=fused.segments, ep_split=True), 2, 2),
               ("down_proj", ShardSpec(2, ep_split=True), 2, 2), ("down_proj", ShardSpec(ep_split=True), 1, 4)]
    for param, spec, tp, ep in layouts:
        name = f"model.layers.1.mlp.experts.{param}"
        for ep_rank in range(ep):
            for tp_rank in range(tp):
                reader.reads.clear()
                got = sources[name].read(reader, spec, tp_size=tp, tp_rank=tp_rank, ep_size=ep, ep_rank=ep_rank)
                want = spec.local_chunk(spec.ep_chunk(full[name], ep, ep_rank), tp, tp_rank)
                assert torch.equal(got, want), (param, spec, ep_rank, tp_rank)
                experts = {int(k.split(".experts.")[1].split(".")[0]) for k, _ in reader.reads}
                per_rank = 4 // ep // (tp if spec.dim == 0 else 1)
                first = ep_rank * (4 // ep) + (tp_rank * per_rank if spec.dim == 0 else 0)
                assert experts == set(range(first, first + per_rank)), (param, spec, ep_rank, tp_rank, experts)
                assert sum(n for _, n in reader.reads) == want.numel() * want.element_size(), (param, spec)


def test_a_conversion_the_reader_cannot_slice_is_named():
    """An operation tptrain cannot read slice by slice is refused naming the model type, the rule, the op and the
    tensor (raised while checking the checkpoint: before any collective)."""
    from transformers.core_model_loading import Conv3dToLinear, WeightConverter

    from tptrain.hf.conversions import _build

    class _Shapes:
        def shape(self, key):
            return (4, 8)

    rule = WeightConverter("patch.w.weight", "patch.v.weight", operations=[Conv3dToLinear(3, (2, 2, 2))])
    toy = torch.nn.Module()
    toy.config = SimpleNamespace(model_type="toy")
    with pytest.raises(ValueError, match=r"'toy'.*'model.patch.w.weight'.*Conv3dToLinear.*MergeModulelist"):
        _build(toy, rule, "model.patch.v.weight", {"patch.w.weight": ["model.patch.w.weight"]}, _Shapes())


def test_rope_permuted_and_transposed_tensors_are_read_per_rank(tmp_path):
    """kimi_k25's tower (one fused `wqkv` cut by Chunk, then q and k rows permuted from interleaved rotary pairs to
    rotate-half per head: PermuteForRope) and nemotron's experts (Transpose(1, 2)): each tp rank reads only its rows,
    no byte more, equal to its piece of transformers' own ops on the whole tensors."""
    from transformers.core_model_loading import Chunk, PermuteForRope, Transpose, WeightConverter

    from tptrain.hf.conversions import _build
    from tptrain.io import save_checkpoint
    stored = {"v.wqkv.weight": torch.randn(3 * 16, 4), "v.wqkv.bias": torch.randn(3 * 16),
              "e.experts.up": torch.randn(2, 8, 6)}
    save_checkpoint(stored, tmp_path)
    toy = torch.nn.Module()
    toy.config = SimpleNamespace(model_type="toy", vision_config=SimpleNamespace(num_attention_heads=2))
    toy.register_parameter("up", torch.nn.Parameter(torch.empty(2, 6, 8, device="meta")))
    permute = PermuteForRope(subconfig_key="vision_config", permute_layer_names=["q_proj", "k_proj"])
    reader = _CountingReader(tmp_path)
    for key, kind in (("weight", "weight"), ("bias", "bias")):
        qkv = WeightConverter("wqkv." + kind, [f"{p}_proj.{kind}" for p in "qkv"], operations=[Chunk(0), permute])
        sources = _build(toy, qkv, f"v.q_proj.{kind}", {qkv.source_patterns[0]: [f"v.wqkv.{key}"]}, reader)
        chunks = Chunk(0).convert({"w": stored[f"v.wqkv.{key}"]}, ["w"], qkv.target_patterns)
        full = permute.convert(chunks, ["w"], qkv.target_patterns, config=toy.config)
        for target, want in full.items():
            for rank in range(2):
                reader.reads.clear()
                got = sources[f"v.{target}"].read(reader, ShardSpec(0), tp_size=2, tp_rank=rank)
                assert torch.equal(got, ShardSpec(0).local_chunk(want, 2, rank)), (target, rank)
                assert sum(n for _, n in reader.reads) == got.numel() * got.element_size()
    assert not torch.equal(full["q_proj.bias"], chunks["q_proj.bias"])  # a permutation that moves rows
    rule = WeightConverter("experts.up", "up", operations=[Transpose(1, 2)])
    source = _build(toy, rule, "up", {"experts.up": ["e.experts.up"]}, reader)["up"]
    for spec in (ShardSpec(1), ShardSpec(2)):
        for rank in range(2):
            got = source.read(reader, spec, tp_size=2, tp_rank=rank)
            assert torch.equal(got, spec.local_chunk(stored["e.experts.up"].transpose(1, 2), 2, rank))


@pytest.mark.parametrize("inverse", [False, True])
def test_interleaved_rows_are_read_from_where_they_come(tmp_path, inverse):
    """inkling2's `Interleave(dim=1)` (gate and up rows alternating on disk): each rank's rows of each half are read
    from the rows they come from, no byte more, equal to transformers' own op on the whole tensor."""
    from transformers.core_model_loading import Interleave

    from tptrain.hf.conversions import Converted, Interleaved, Tensor
    from tptrain.io import save_checkpoint
    stored = torch.randn(3, 8, 4)
    save_checkpoint({"w": stored}, tmp_path)
    full = Interleave(dim=1, inverse=inverse).convert({"w": stored}, ["w"], ["t"])["t"]
    reader = _CountingReader(tmp_path)
    source = Converted("Interleave", Interleaved(Tensor("w", (3, 8, 4)), 1, inverse))
    spec = ShardSpec(1, segments=((4, 1), (4, 1)))
    for rank in range(2):
        reader.reads.clear()
        got = source.read(reader, spec, tp_size=2, tp_rank=rank)
        want = spec.local_chunk(full, 2, rank)
        assert torch.equal(got, want), rank
        assert sum(n for _, n in reader.reads) == want.numel() * want.element_size()


def test_a_prefix_rule_for_another_class_of_the_type_is_not_applied(tmp_path):
    """shieldgemma2's rule adds the `model.` of ShieldGemma2ForImageClassification (which wraps the Gemma 3 model);
    AutoModelForImageTextToText builds that Gemma 3 model itself, whose names it would all rename away: the checkpoint
    transformers saves of it loads into every parameter, each equal to transformers' own."""
    import transformers

    from tptrain.hf.conversions import checkpoint_sources
    from tests.helpers.vlm import _GEMMA3, _SIGLIP
    config = transformers.ShieldGemma2Config(text_config=_GEMMA3, vision_config=_SIGLIP, mm_tokens_per_image=4,
                                             image_token_index=120, boi_token_index=121, eoi_token_index=122)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    reader = CheckpointReader(tmp_path)
    sources = checkpoint_sources(model, reader)
    assert sources and set(sources) | set(reader.keys()) >= set(dict(model.named_parameters()))
    for name, value in model.named_parameters():  # the tied lm_head: the embedding's
        key = sources.get(name, name)
        assert isinstance(key, str) and torch.equal(reader.read(key), value), name


def test_saving_a_transposed_rule_compares_global_shapes():
    """qwen3_vl_moe's experts: transformers' reverse `Transpose(check_dims=True)` transposes a tensor whose shape is
    not the parameter's. On a rank of a split model the parameter is its piece, the tensor saved the whole: still
    written untransposed (here square, 2 x 32 = 64: a transposed one would reload transposed)."""
    import transformers

    from tptrain.hf.conversions import to_hub
    config = transformers.CONFIG_MAPPING["qwen3_vl_moe"](
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                         num_experts=4, num_experts_per_tok=2), vision_config=dict(depth=1, hidden_size=32,
                                                                                   intermediate_size=48, num_heads=4,
                                                                                   out_hidden_size=64))
    model = transformers.AutoModelForImageTextToText.from_config(config)
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    full = model.get_parameter(name).detach().clone()
    assert full.shape == (4, 64, 64)
    experts = model.get_submodule(name.rpartition(".")[0])
    experts.gate_up_proj = torch.nn.Parameter(full[:, :32].clone())  # this rank's rows, as tp 2 holds them
    assert torch.equal(to_hub(model, {name: full})[name], full)


def test_text_and_vision_experts_split_from_one_list_are_read_per_rank(tmp_path):
    """ernie4_5_vl_moe's experts: one list per projection (gate, up) holding the text experts then the vision ones;
    transformers cuts each list in two, stacks each half and puts gate beside up (ErnieFuseAndSplitTextVisionExperts).
    Each (ep rank, tp rank) reads only its experts' rows, equal to its piece of transformers' own result."""
    from transformers.core_model_loading import ErnieFuseAndSplitTextVisionExperts, WeightConverter

    from tptrain.hf.conversions import _build
    from tptrain.io import save_checkpoint
    stored = {f"mlp.experts.{e}.{p}.weight": torch.randn(6, 4) for e in range(4) for p in ("gate_proj", "up_proj")}
    save_checkpoint(stored, tmp_path)
    op = ErnieFuseAndSplitTextVisionExperts(stack_dim=0, concat_dim=1)
    rule = WeightConverter(["experts.*.gate_proj.weight", "experts.*.up_proj.weight"],
                           ["text_moe.experts.gate_up_proj", "vision_moe.experts.gate_up_proj"], operations=[op])
    keys = {p: [f"mlp.experts.{e}.{p.split('.')[2]}.weight" for e in range(4)] for p in rule.source_patterns}
    toy = torch.nn.Module()
    toy.config = SimpleNamespace(model_type="toy")
    sources = _build(toy, rule, "mlp.text_moe.experts.gate_up_proj", keys, _CountingReader(tmp_path))
    full = op.convert({p: [stored[k] for k in ks] for p, ks in keys.items()}, rule.source_patterns,
                      rule.target_patterns, config=toy.config)
    reader = _CountingReader(tmp_path)
    for target, want in full.items():
        assert want.shape == (2, 12, 4)
        for spec, tp, ep in ((ShardSpec(1), 2, 1), (ShardSpec(1, ep_split=True), 1, 2)):
            for rank in range(max(tp, ep)):
                reader.reads.clear()
                got = sources[f"mlp.{target}"].read(reader, spec, tp_size=tp, tp_rank=rank % tp, ep_size=ep,
                                                    ep_rank=rank % ep)
                assert torch.equal(got, spec.local_chunk(spec.ep_chunk(want, ep, rank % ep), tp, rank % tp))
                assert sum(n for _, n in reader.reads) == got.numel() * got.element_size()
