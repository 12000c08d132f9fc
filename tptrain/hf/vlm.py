"""TransformersImageTextToText: a transformers image-text-to-text model (`*ForConditionalGeneration`: a vision
tower, a projector, a text decoder) run by tptrain's engine, every part split.

    model = AutoModelForImageTextToText.from_pretrained("Qwen/Qwen2.5-VL-3B-Instruct", dtype=torch.bfloat16,
                                                        distributed_config=DistributedConfig(tp_size=2))
    out = model(**processor(text=..., images=...), labels=labels)   # transformers' input names; tptrain's loss

Everything of the causal backend (TransformersCausalLM) holds: built on meta, each rank reads only its slices,
the vocab-parallel loss, KV heads replicated when tp_size exceeds them, saving through transformers' own reverse
conversions. What differs is the plan: transformers merges each sub-model's config plan under that sub-model's
place in the module tree (the text decoder's `base_model_tp_plan` under `model.language_model`, a vision config's
under the tower), and so does tptrain, from the tree itself (no prefix to get wrong). Where the tower or the
projector has no plan, tptrain derives one (hf/towers.py) or keeps it whole. Head counts are each attention
module's own (`tp_heads`: the text config's, the vision config's). `save_pretrained` writes the processor files
of the checkpoint it was loaded from beside the weights.

Not yet: context parallelism (the merged sequence split after the image embeddings are placed) and pipeline stages
(tower and projector on the first stage): both refused by the rule table.
"""
from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
import transformers
from transformers.models.auto.modeling_auto import (MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
                                                    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

from tptrain.hf.attention import declare_cp_facts
from tptrain.hf.model import ConfigLoader, TransformersCausalLM, _init_owner
from tptrain.hf.stages import stage_parts
from tptrain.hf.plan import declare_tp_facts, resolve_names, translate_plan, vocab_parallel_embedding
from tptrain.hf.towers import decoder_name, derive_plan, localise_heads, tower_facts, tower_roots
from tptrain.io import resolve_checkpoint
from tptrain.io.hub import PROCESSOR_PATTERNS

TASK = "image-text-to-text"


def knows(model_type: str | None) -> bool:
    """Whether transformers has an image-text-to-text class for `model_type`."""
    return model_type in transformers.CONFIG_MAPPING and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


class TransformersImageTextToText(TransformersCausalLM):
    """tptrain's engine on a transformers image-text-to-text model. Build with `from_pretrained` / `from_config`."""

    config_class = ConfigLoader(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, TASK)
    auto_class = "AutoModelForImageTextToText"

    def _declared_plans(self, hf_model: nn.Module, prefix: str) -> tuple[dict[str, str], dict[str, str]]:
        """Every sub-model's declared plan under its own name and the input embedding vocab-parallel, split into the
        base model's (relative to `prefix`) and the rest (full names); the tower and projector's derived plans, where
        they declare none, are optional (`tp_optional_plans`: each kept whole at a tp size it does not divide)."""
        declared = submodel_plans(hf_model)
        plan = translate_plan(declared)
        embed = hf_model.get_input_embeddings()
        name = next((n for n, m in hf_model.named_modules() if m is embed), None)
        if plan and name and vocab_parallel_embedding(embed, name, declared):
            plan = {name: "embedding_rowwise", **plan}
        self._text_decoder = decoder_name(hf_model)
        self.layer_list = f"{self._text_decoder}.layers"  # FSDP2's units (the tower stays in the root's: input_reach)
        derived, self._tower_attention = derive_plan(hf_model, tower_roots(hf_model, plan))
        self.tp_optional_plans = {f"{root} ({type(hf_model.get_submodule(root)).__name__}, tptrain's derived plan)":
                                  rules for root, rules in derived.items()}
        base = {g[len(prefix) + 1:]: s for g, s in plan.items() if g.startswith(prefix + ".")}
        # rules naming no module are a variant's or a class's stray ones (Llama 4's head rules under its text model)
        return base, {g: s for g, s in plan.items() if not g.startswith(prefix + ".") and resolve_names(hf_model, {g: s})}

    def _declare_tp_facts(self, plan: dict[str, str]) -> None:
        """Each module's facts from its own sub-model's config (the text config's heads, the vision config's);
        the derived tower attention split by its own head count, no KV heads to replicate; why its sequence cannot
        be split (`sp_refusal`, the rule table's `sp_refused`)."""
        optional = {glob: style for rules in self.tp_optional_plans.values() for glob, style in rules.items()}
        declare_tp_facts(self, {**plan, **optional}, self.config, config_of=lambda name: _init_owner(self, name).config)
        for name, (heads, _) in self._tower_attention.items():
            module = self.get_submodule(name)
            module.tp_heads, module.tp_kv_projections = (heads, heads), ()
        self.sp_refusal = (f"its decoder's input, the merged sequence (the image features put in place of the whole "
                           f"row's placeholders, and multimodal rotary positions computed from the whole row), is "
                           f"made inside transformers' forward of {type(self.hf_model).__name__} before the first "
                           f"decoder layer, and transformers' modules take their shapes from their input: no layer "
                           f"can be handed a shard of the sequence")

    def _declare_stages(self, prefix: str) -> None:
        """The causal backend's cut of the text decoder's layers (hf/stages.py), the tower and projector on the first
        stage beside the embedding."""
        self._declare_stage_parts(stage_parts(self, prefix, self._text_decoder or None))

    def input_positions(self, input_ids: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor | None:
        """(batch, rows, seq): the multimodal RoPE position ids (time, height, width) transformers' forward computes
        from the whole rows' ids, image grids and token types (`compute_3d_position_ids`: Qwen2-VL and its kin), which
        every pipeline stage needs; None where the model's positions are the plain 0..seq-1 (contract.PipelineModel)."""
        compute = getattr(getattr(self, self.base_model_prefix), "compute_3d_position_ids", None)
        if compute is None:
            return None
        given = {"input_ids": input_ids, **inputs}
        named = [p.name for p in inspect.signature(compute).parameters.values()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        positions = compute(**{name: given.get(name) for name in named})
        return None if positions is None else positions.movedim(1, 0)

    def _declare_cp_facts(self, prefix: str) -> None:
        """Context parallelism splits the merged sequence where it enters the text decoder (`cp_sequence_entry`),
        after transformers' forward has run the tower and projector on every image, placed their features and
        computed the position ids (multimodal RoPE's too) on the whole sequence: `attend` on the text decoder's
        attention modules only, the masks through the base model (hf/attention.py)."""
        self.cp_sequence_entry = self._text_decoder
        layers = getattr(self, "pp_layers", None) or f"{self._text_decoder}.layers"
        self.sequence_mixers = declare_cp_facts(self, getattr(self, prefix), layers, within=self._text_decoder)

    def _set_local_heads(self) -> None:
        """The text decoder's as the causal backend's; each attention outside it split by heads (the tower's) gets
        this rank's head count in the attributes its forward may reshape by."""
        super()._set_local_heads()
        if self.tp_size == 1:
            return
        for name, module in self.named_modules():
            heads = getattr(module, "tp_heads", None)
            split = any(f"{name}.{child}" in self.tp_plan for child, _ in module.named_children())
            if heads is None or not split or name.startswith(self._text_decoder + "."):
                continue
            width = self._tower_attention.get(name, (None, heads[0] * getattr(module, "head_dim", 0)))[1]
            localise_heads(module, heads[0], width, self.tp_size)

    def input_dependent_parameters(self) -> list[str]:
        """The parameters only a batch with images reaches: all but the text decoder's and the output head's (the
        tower's, the projector's; the Trainer keeps them in step over dp ranks: training/input_reach.py)."""
        head = next(n for n, m in self.named_modules() if m is self.get_output_embeddings())
        return [n for n, _ in self.named_parameters()
                if not n.startswith((self._text_decoder + ".", head + "."))]

    def tower_facts(self) -> dict | None:
        """The vision tower's widths and variants for the memory planner (hf/towers.py `tower_facts`)."""
        head = next(n for n, m in self.named_modules() if m is self.get_output_embeddings())
        return tower_facts(self.hf_model, (self._text_decoder, head))

    def extra_files(self) -> dict[str, bytes]:
        """The processor's files (image processor, tokenizer, chat template) of the checkpoint this model was
        loaded from, written beside its weights."""
        source = getattr(self, "name_or_path", None)
        return processor_files(resolve_checkpoint(source)) if source else {}


def submodel_plans(hf_model: nn.Module) -> dict[str, str]:
    """transformers' own merge of a composite model's plans (`init_parallel_plans`), in full module names: each base
    model's config `base_model_tp_plan` and each model's class-level `_tp_plan` (its head), under its own name;
    without the vocab-parallel embedding transformers adds to any base model (tptrain decides that itself)."""
    from transformers import PreTrainedModel

    plan: dict[str, str] = {}
    for name, module in hf_model.named_modules():
        if not isinstance(module, PreTrainedModel):
            continue
        at = f"{name}." if name else ""
        rules = dict(getattr(type(module), "_tp_plan", None) or {})
        if module.base_model is module:
            rules.update(getattr(module.config, "base_model_tp_plan", None) or {})
        plan.update({f"{at}{glob}": style for glob, style in rules.items()})
    return plan


def processor_files(directory: str | os.PathLike) -> dict[str, bytes]:
    """{file name: bytes} of the processor files in `directory` (io.hub.PROCESSOR_PATTERNS)."""
    directory = Path(directory)
    return {path.name: path.read_bytes() for pattern in PROCESSOR_PATTERNS for path in sorted(directory.glob(pattern))
            if path.is_file()}


def load_processor(directory: str | os.PathLike) -> Any:
    """The checkpoint's processor (transformers' AutoProcessor: image processor, tokenizer, chat template), or a
    ValueError naming the directory and what it lacks."""
    directory = Path(directory)
    if not (directory / "preprocessor_config.json").is_file() and not (directory / "processor_config.json").is_file():
        raise ValueError(f"{directory} holds no processor (no preprocessor_config.json or processor_config.json): a "
                         f"vision-language model needs the processor it was trained with to turn images and text into "
                         f"its inputs; copy the processor files of its hub repository into {directory} "
                         f"(processor.save_pretrained({str(directory)!r}))")
    return transformers.AutoProcessor.from_pretrained(directory)
