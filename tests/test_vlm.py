"""Vision-language models (tptrain.AutoModelForImageTextToText, the transformers backend): the text decoder split by
its config's plan, the vision tower and projector by theirs or by the plan tptrain derives, against transformers on
one process (fp64): the loss, every gradient (the tower's too) and 3 AdamW steps at tp 2 and tp 4 (4 query heads,
2 KV heads: tp 4 replicates them), and the checkpoint saved at tp reloaded by transformers, bit for bit.

    .venv-vision/bin/python -m pytest tests/test_vlm.py -q
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import run_distributed
from tests.helpers.vlm import F64, FAMILIES, TEXT, VisionCheckpoints, batch, equivalence, transformers_model

pytestmark = pytest.mark.vision
TYPES = tuple(FAMILIES)


def _with_processor_file(model_type, path, hf):
    """(the directory, with a processor file beside the weights, a labelled batch)."""
    (path / "preprocessor_config.json").write_text('{"test": "copied beside the weights"}\n')
    return path, batch(model_type, hf)


# {model_type: (directory written by transformers, a labelled batch)}, and a processor file beside each
CHECKPOINTS = VisionCheckpoints(TYPES, _with_processor_file)


def _tp_worker(tp: int, checkpoints: dict, save_root) -> None:
    import warnings

    from tptrain import AutoModelForImageTextToText, DistributedConfig
    for model_type, (path, inputs) in checkpoints.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = AutoModelForImageTextToText.from_pretrained(
                path, dtype=F64, distributed_config=DistributedConfig(tp_size=tp)).train()
        assert model.backend == "transformers" and model.tp_size == tp
        split = [n for n, spec in model.parallel.tp.specs.items() if spec.dim is not None]
        text = [n for n in split if n.startswith(model._text_decoder + ".")]
        tower = [n for n in split if n not in text and "lm_head" not in n]
        whole = model_type == "llava_2_vision_heads" and tp == 4  # its projector still split
        blocks = [n for n in tower if any(f".{b}." in n for b in ("layers", "layer", "blocks"))]  # the encoder's
        assert text and tower and bool(blocks) != whole, (model_type, tower)
        notes = [str(w.message) for w in caught if "kept whole on every rank" in str(w.message)]
        assert len(notes) == (whole and torch.distributed.get_rank() == 0), notes
        model.save_pretrained(save_root / model_type)
        equivalence(model, transformers_model(path), inputs)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_transformers_and_saves_for_transformers(checkpoints, tmp_path, tp):
    run_distributed(_tp_worker, tp, tp, checkpoints, tmp_path, timeout=600)
    for model_type, (path, _) in checkpoints.items():
        saved, original = transformers_model(tmp_path / model_type), transformers_model(path)
        assert type(saved) is type(original)
        for (name, p), (_, q) in zip(saved.named_parameters(), original.named_parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m: f"{model_type} {name}: {m}")
        assert (tmp_path / model_type / "preprocessor_config.json").read_text() == \
            (path / "preprocessor_config.json").read_text()


def test_each_attention_is_checked_by_its_own_heads_and_a_tower_that_does_not_split_stays_whole():
    """Plan checks without processes: the text decoder's heads (4, 2 KV) and the tower's (4) each named where they do
    not divide tp; a tower whose heads do not divide tp is kept whole with a note instead, and the tp sizes
    `tptrain plan` suggests count only what must split."""
    from tptrain.hf.vlm import TransformersImageTextToText
    from tptrain.parallel.plan import check_plan, working_tp_sizes
    model = TransformersImageTextToText.from_config(FAMILIES["qwen2_5_vl"].config(), device="meta")
    problems = check_plan(model, "auto", 3).problems
    assert any(p.startswith("model.language_model.layers.*.self_attn: num_attention_heads=4") for p in problems)
    assert any(p.startswith("model.language_model.layers.*.self_attn: tp_size=3 exceeds num_key_value_heads=2")
               for p in problems)
    assert not any("model.visual" in p for p in problems), problems  # the tower's rules are optional: whole there
    assert working_tp_sizes(model) == [1, 2, 4]
    two_heads = TransformersImageTextToText.from_config(FAMILIES["llava_2_vision_heads"].config(), device="meta")
    resolved = check_plan(two_heads, "auto", 4)
    assert not resolved.problems and not any(n.startswith("model.vision_tower.") for n in resolved.styles)
    assert [n.split(" (")[0] for n in resolved.notes] == ["model.vision_tower"]
    assert "num_attention_heads=2 is not divisible by tp_size=4" in resolved.notes[0]
    assert any(n.startswith("model.multi_modal_projector.") for n in resolved.styles)  # its own group: it splits


def test_a_text_only_checkpoint_is_refused(tmp_path):
    """A text-only checkpoint is no image-text-to-text model (cp and pp: tests/test_vlm_axes.py)."""
    import transformers

    from tptrain import AutoModelForImageTextToText
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TEXT)
                                  ).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="not an image-text-to-text model.*AutoModelForCausalLM"):
        AutoModelForImageTextToText.from_pretrained(tmp_path / "llama")


def test_a_tower_output_projection_registered_first_and_grouped_kv_heads():
    """Exaone 4.5's tower attention registers its output projection `proj` before its fused `qkv`: the derived plan
    still splits qkv by columns (its q, k and v each alone) and proj by rows; with fewer KV heads than query heads
    (its real configs: 16 and 8, q, k and v of unequal widths) the attention stays whole (its MLP still splits)."""
    from tptrain.hf.vlm import TransformersImageTextToText
    from tptrain.parallel.plan import check_plan

    def plan(kv_heads: int) -> dict:
        config = _exaone4_5(kv_heads)
        model = TransformersImageTextToText.from_config(config, device="meta")
        resolved = check_plan(model, "auto", 2)
        assert not resolved.problems, resolved.problems
        return {n: s for n, s in resolved.styles.items() if n.startswith("model.visual.blocks.0.")}

    split = plan(4)
    assert split["model.visual.blocks.0.attn.proj"] == "rowwise", split
    assert split["model.visual.blocks.0.attn.qkv"] == "fused_colwise", split
    grouped = plan(2)
    assert not any(".attn." in n for n in grouped) and any(".mlp." in n for n in grouped), grouped


def _exaone4_5(kv_heads: int):
    import transformers
    return transformers.CONFIG_MAPPING["exaone4_5"](
        text_config=dict(TEXT, model_type="exaone4"), vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=48, num_heads=4, num_key_value_heads=kv_heads,
            out_hidden_size=32, patch_size=4, spatial_merge_size=2, fullatt_block_indexes=[0]), image_token_id=120)


def test_per_head_norms_of_a_model_whose_own_forward_does_not_run_on_meta():
    """Qwen3-Omni's thinker does not run its forward on meta ids; its text decoder does, so the probe finds the
    decoder's q_norm and k_norm act on this rank's heads ('replicated_with_grad_allreduce') and tp 2 has no problem."""
    import transformers

    from tptrain.hf.vlm import TransformersImageTextToText
    from tptrain.parallel.plan import check_plan
    config = transformers.CONFIG_MAPPING["qwen3_omni_moe_thinker"](
        text_config=dict(TEXT, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2])),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=32,
                           deepstack_visual_indexes=[0]),
        audio_config=dict(encoder_layers=1, d_model=32, encoder_attention_heads=4, encoder_ffn_dim=48,
                          output_dim=32))
    model = TransformersImageTextToText.from_config(config, device="meta")
    resolved = check_plan(model, "auto", 2)
    assert not resolved.problems, resolved.problems
    for norm in ("q_norm", "k_norm"):
        assert resolved.styles[f"model.language_model.layers.0.self_attn.{norm}"] == "replicated_with_grad_allreduce"


def test_square_projections_the_output_one_by_name():
    """Kimi K2.5's tower attention: `proj` registered before q_proj, k_proj and v_proj, all 64 x 64 (any could read
    the others' outputs by shape): the one named as an output projection is split by rows, the rest by columns."""
    from torch import nn

    from tptrain.hf.towers import derive_plan

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads, self.head_dim = 4, 16
            self.proj = nn.Linear(64, 64)
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    tower = nn.Module()
    tower.attn = Attention()
    plans, heads = derive_plan(tower, ["attn"])
    assert plans == {"attn": {"attn.proj": "rowwise", **{f"attn.{p}_proj": "colwise" for p in "qkv"}}}
    assert heads == {"attn": (4, 64)}


def test_a_timm_block_stays_whole():
    """timm's blocks (Perception LM's and FastVLM's towers, through TimmWrapper) reshape their attention output to
    their input's width, which a split by heads would halve: no plan is derived for them."""
    from torch import nn

    from tptrain.hf.towers import derive_plan

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads = 4
            self.qkv, self.proj = nn.Linear(64, 192), nn.Linear(64, 64)

    tower = nn.Module()
    tower.attn = Attention()
    assert derive_plan(tower, ["attn"])[0] == {"attn": {"attn.qkv": "fused_colwise", "attn.proj": "rowwise"}}
    Attention.__module__ = "timm.models.eva"
    assert derive_plan(tower, ["attn"]) == ({}, {})
