"""TransformersCausalLM: a transformers `*ForCausalLM` run by tptrain's engine (the "transformers" backend).

For a model_type tptrain has no native implementation of. transformers' own modeling code does the math; tptrain
does everything parallel, exactly as for its native models: the model is built on the meta device, the config's
`base_model_tp_plan` (translated to tptrain's styles, plus the vocab-parallel embedding) is checked by `check_plan`
and applied by `apply_tensor_parallel`, each rank reads only its slice (`read_shard`), the loss is the
vocab-parallel one, KV heads are replicated when tp_size > num_key_value_heads (the attention modules' per-rank
head counts are patched; transformers' own TP refuses that), and saving, the Trainer, DCP and LoRA see an
ordinary tptrain model: parameter names are transformers' (`model.layers.0.self_attn.q_proj.weight`).

    model = AutoModelForCausalLM.from_pretrained("bigcode/starcoder2-3b", dtype=torch.bfloat16,
                                                 distributed_config=DistributedConfig(tp_size=4))
    model.backend  # "transformers"

The transformers model is not a submodule: its children (`model`, `lm_head`) are this module's, so parameter
names, hooks and `.to()` are the same as for a native model.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any

import torch
import transformers
from torch import nn
from transformers.integrations.moe import _default_apply_gate
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tptrain.hf import styles as _styles  # noqa: F401 - registers the ep_dispatch_experts styles
from tptrain.hf.attention import declare_cp_facts, running, use_tptrain_attention
from tptrain.hf.checkpoint import hub_tensors, materialise_buffers
from tptrain.hf.conversions import checkpoint_sources, interleaved_parameters
from tptrain.hf.documents import declare_packed_documents
from tptrain.hf.plan import (base_prefix, declare_tp_facts, module_rules, parameter_rules,
                             translate_plan, unplanned_parameters, vocab_parallel_embedding, packed_like_stored)
from tptrain.hf.probe import rule_unplanned
from tptrain.hf.stages import run_stage, stage_parts
from tptrain.dtypes import dtype_name
from tptrain.losses import CausalLMOutput, causal_lm_loss
from tptrain.meta_init import build_on
from tptrain.modeling import PreTrainedModel
from tptrain.models.configuration import load_config_dict
from tptrain.parallel import contract

TESTED = "5.23"  # the `tptrain[hf]` extra's range (>=5.23,<5.24): what the tests ran against


def load_config(path_or_id: str | os.PathLike | dict, *, mapping=MODEL_FOR_CAUSAL_LM_MAPPING,
                task: str = "causal-LM") -> Any:
    """transformers' config for a checkpoint directory / hub id (or a config.json dict) of a model type with a
    class in `mapping` (transformers' auto mapping of `task`); custom code refused."""
    config_dict = path_or_id if isinstance(path_or_id, dict) else load_config_dict(path_or_id)
    # transformers writes inf / nan as {"__float__": "Infinity"} (nemotron_h's time_step_limit) and reads them back so
    config_dict = transformers.PretrainedConfig._decode_special_floats(config_dict)
    model_type = config_dict.get("model_type")
    if not transformers.__version__.startswith(TESTED + "."):
        warnings.warn(f"tptrain's transformers backend is tested with transformers {TESTED}.x; "
                      f"{transformers.__version__} is installed (pip install \"tptrain[hf]\" installs a tested one)",
                      stacklevel=2)
    if config_dict.get("auto_map"):
        raise ValueError(f"{path_or_id if not isinstance(path_or_id, dict) else model_type!r}: config.json has "
                         f"auto_map, i.e. modeling code from the hub (trust_remote_code); tptrain's transformers "
                         f"backend runs only transformers' own model classes. Out of scope.")
    try:
        config_class = transformers.CONFIG_MAPPING[model_type]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} is known neither to tptrain nor to transformers "
                         f"{transformers.__version__}") from None
    config = config_class.from_dict({k: v for k, v in config_dict.items() if k != "model_type"})
    if type(config) not in mapping:
        raise ValueError(f"transformers has no {task} class for model_type {model_type!r}")
    return config


def knows(model_type: str | None) -> bool:
    """Whether transformers has a causal-LM class for `model_type`."""
    return model_type in transformers.CONFIG_MAPPING and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _eager_experts_for(hf: nn.Module, dtype: torch.dtype | None) -> None:
    """transformers' default experts kernel (grouped_mm) takes fp32 / bf16 / fp16 only: other dtypes (fp64) run
    its per-expert loop ("eager"), as transformers' own tests do."""
    if dtype not in (None, torch.float32, torch.bfloat16, torch.float16) and hasattr(hf, "set_experts_implementation"):
        hf.set_experts_implementation("eager")


def _halved_gate_up(hf_model: nn.Module) -> dict[str, int]:
    """{name: 1} of the stacked experts' `gate_up_proj` that transformers' experts interface halves into [gate; up]
    (`@use_experts_implementation`'s default `_apply_gate`): a plain 'colwise' rule on it (Inkling's) would give
    rank 0 only gate rows; each half is split alone instead (see `plan.packed_like_stored`)."""
    return {f"{name}.gate_up_proj": 1 for name, module in hf_model.named_modules()
            if getattr(type(module), "_apply_gate", None) is _default_apply_gate
            and isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and module.gate_up_proj.dim() == 3}


class ConfigLoader:
    """`config_class` of a transformers-backend model: what `PreTrainedModel._open_checkpoint` calls."""

    def __init__(self, mapping, task: str) -> None:
        self.mapping, self.task = mapping, task

    def from_pretrained(self, directory) -> Any:
        return load_config(directory, mapping=self.mapping, task=self.task)


class TransformersCausalLM(PreTrainedModel):
    """tptrain's engine on a transformers causal LM. Build with `from_pretrained` / `from_config`."""

    backend = "transformers"
    config_class = ConfigLoader(MODEL_FOR_CAUSAL_LM_MAPPING, "causal-LM")
    auto_class = "AutoModelForCausalLM"  # transformers' auto class of the task

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__(hf_model.config)
        object.__setattr__(self, "hf_model", hf_model)  # not registered: its children are ours
        own = [n for n, _ in hf_model.named_parameters(recurse=False)] + [n for n, _ in hf_model.named_buffers(recurse=False)]
        if own:
            raise ValueError(f"{type(hf_model).__name__} holds tensors {own} outside its submodules; tptrain's "
                             f"transformers backend does not support it")
        object.__setattr__(self, "_modules", hf_model._modules)  # one dict: a pipeline cut is transformers' too
        self.base_model_prefix = prefix = base_prefix(hf_model)
        self.loss_function = causal_lm_loss
        base, head = self._declared_plans(hf_model, prefix)
        param_specs, self._parameter_rules = parameter_rules(self, {f"{prefix}.{g}": s for g, s in base.items()})
        interleaved = {**interleaved_parameters(hf_model), **_halved_gate_up(hf_model)}
        for owner, specs in param_specs.items():  # read by the owner's style (per_parameter_rules)
            self.get_submodule(owner).tp_param_specs = {
                leaf: packed_like_stored(spec, self.get_parameter(f"{owner}.{leaf}").shape,
                                         interleaved.get(f"{owner}.{leaf}")) for leaf, spec in specs.items()}
        # Read by parallel/plan.py instead of the config's plan (which is in transformers' spelling). Module rules
        # only; rules matching no module are a variant's (q_proj where this config has q_a_proj / q_b_proj).
        self.tp_base_plan = module_rules(self, base, prefix)
        self._tp_plan = head
        # What enable_expert_parallel adds (read instead of the config's base_model_ep_plan, transformers' spelling).
        self.tp_ep_plan = module_rules(self, translate_plan(getattr(hf_model.config, "base_model_ep_plan", None)),
                                       prefix)
        self._declare_tp_facts({**{f"{prefix}.{g}": s for g, s in self.tp_base_plan.items()}, **self._tp_plan})
        self._whole_readers = rule_unplanned(self, prefix)
        self._declare_stages(prefix)
        self._declare_cp_facts(prefix)
        self._declare_packed_documents()

    def _declared_plans(self, hf_model: nn.Module, prefix: str) -> tuple[dict[str, str], dict[str, str]]:
        """(the base model's plan, relative to `prefix`; the rules outside it, the head's, in full names), in tptrain's
        style names: the config's base_model_tp_plan, the input embedding vocab-parallel as tptrain's own plans make
        it (Gemma's scaled one too), and the class-level `_tp_plan`."""
        raw = type(hf_model.config).base_model_tp_plan or getattr(hf_model.config, "base_model_tp_plan", None)
        base = translate_plan(raw)
        embed = hf_model.get_input_embeddings()
        name = next((n for n, m in getattr(hf_model, prefix).named_modules() if m is embed), None)
        if base and name and vocab_parallel_embedding(embed, name, raw):
            base = {name: "embedding_rowwise", **base}
        return base, translate_plan(getattr(type(hf_model), "_tp_plan", None) or {})

    def _declare_tp_facts(self, plan: dict[str, str]) -> None:
        """hf.plan.declare_tp_facts with the model's plan (full names), every fact from the model's config."""
        declare_tp_facts(self, plan, self.config)

    def _declare_cp_facts(self, prefix: str) -> None:
        """Context parallelism's facts: `attend` on the attention modules, the base model's `attention_masks`, and the
        modules of the layers mixing tokens otherwise (hf/attention.py)."""
        self.sequence_mixers = declare_cp_facts(self, getattr(self, prefix), getattr(self, "pp_layers", None))

    def _declare_packed_documents(self) -> None:
        """Token mixers run per packed document, or why not (`packing_refusal`): hf/documents.py."""
        self._packed = declare_packed_documents(self)

    def _declare_stages(self, prefix: str) -> None:
        """The contract's PipelineModel facts (hf/stages.py), or why the model cannot be cut (`pp_refusal`)."""
        self._declare_stage_parts(stage_parts(self, prefix))

    def _declare_stage_parts(self, parts) -> None:
        if isinstance(parts, str):
            self.pp_refusal = f"{type(self.hf_model).__name__} ({self.config.model_type}): {parts}"
            return
        self._stage_parts = parts
        self.pp_layers, self.pp_first, self.pp_last = parts.layers, parts.first, parts.last

    def pipeline_forward(self, x: torch.Tensor, *carried: torch.Tensor, position_ids: torch.Tensor | None = None,
                         **inputs: torch.Tensor) -> torch.Tensor:
        """What this module (a pipeline stage's view, or the whole model) holds of the computation: token ids in if
        it holds the embedding, else the previous stage's hidden states; logits out if it holds the head
        (vocab-sharded under TP for the vocab-parallel loss), else hidden states (hf/stages.py). It carries nothing
        between stages (transformers' router aux loss is not tptrain's loss on this backend). `inputs`: the rest of
        transformers' inputs (a vision-language model's attention mask and token types; its images on the first
        stage); multimodal position ids come batch first, (batch, rows, seq)."""
        assert not carried, "the transformers backend's stages carry nothing"
        attention_mask, cp = inputs.pop("attention_mask", None), self.parallel.cp
        if position_ids is not None and position_ids.dim() == 3:  # transformers' (rows, batch, seq)
            position_ids = position_ids.movedim(1, 0)
        documents = self._packed.of_forward(x.shape[0], position_ids, attention_mask, cp, {})
        if cp is not None and attention_mask is None:  # see forward
            attention_mask = torch.ones(x.shape[:2], dtype=torch.long, device=x.device)
        with running(getattr(self, self.base_model_prefix), cp, position_ids), self._packed.running(documents):
            return run_stage(self, self._stage_parts, x, position_ids=position_ids, attention_mask=attention_mask,
                             use_cache=False, **inputs)

    # ------------------------------------------------------------------ building

    @classmethod
    def from_config(cls, config: Any, *, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> "TransformersCausalLM":
        """transformers' random init, or (device="meta") shapes only for sharded loading."""
        model_class = cls.config_class.mapping[type(config)]
        device = torch.device(device or "cpu")
        if device.type != "meta":
            hf = getattr(transformers, cls.auto_class).from_config(config, dtype=dtype)
            _eager_experts_for(hf, dtype)
            return cls(hf.to(device))
        prev = torch.get_default_dtype()
        if dtype is not None:
            torch.set_default_dtype(dtype)
        try:
            with build_on(device):
                hf = model_class(config)
        finally:
            torch.set_default_dtype(prev)
        _eager_experts_for(hf, dtype)
        return cls(hf)

    def _check_checkpoint(self, reader) -> None:
        """transformers' load-time conversions matched against the checkpoint's names (conversions.py), then
        every parameter's source checked as for a native model."""
        self._checkpoint_sources = checkpoint_sources(self.hf_model, reader)
        super()._check_checkpoint(reader)

    def checkpoint_keys(self) -> dict[str, Any]:
        """The checkpoint names transformers' rules give (a renamed tensor's name, or how a rule builds it); a last
        pipeline stage's copy of a tied weight reads (and is saved as) the first stage's."""
        keys = dict(getattr(self, "_checkpoint_sources", {}))
        return {**keys, **{last: keys.get(first, first) for last, first in self._tied_copies().items()}}

    def _tied_copies(self) -> dict[str, str]:
        """{last stage's name: first stage's name} of the tied weights this rank holds without the first stage."""
        plan = self.parallel.pp
        params = dict(self.named_parameters()) if plan is not None and plan.tied else {}
        return {last: first for first, last in (plan.tied if params else ()) if last in params and first not in params}

    def _checkpoint_tensors(self, names: list[str]):
        return hub_tensors(self, names, self._tied_copies())

    def _load(self, reader, device: torch.device, dtype: torch.dtype) -> None:
        super()._load(reader, device, dtype)
        self._load_buffers(reader, device)
        materialise_buffers(self, device)

    @torch.no_grad()
    def _load_buffers(self, reader, device: torch.device) -> None:
        """Persistent buffers the checkpoint holds (a router's `e_score_correction_bias`), read whole (no plan splits
        a buffer), in the dtype transformers built them in."""
        keys = self.checkpoint_keys()
        for name, buffer in self.named_buffers():
            key = keys.get(name, name)
            if buffer.device.type == "meta" and isinstance(key, str) and key in reader:
                module, _, leaf = name.rpartition(".")
                self.get_submodule(module)._buffers[leaf] = reader.read(key, dtype=buffer.dtype, device=device)

    def tp_plan_problems(self, styles: dict[str, str], tp_size: int) -> list[str]:
        """Problems `check_plan` adds for this model (see `plan.unplanned_parameters`)."""
        if tp_size == 1:
            return []
        unplanned = [re.sub(r"\.\d+\.", ".*.", p) for p in unplanned_parameters(self, styles, self._whole_readers)]
        return list(dict.fromkeys([*self._parameter_rules.values(), *unplanned]))

    def _apply_plan(self, resolved, distributed_config, *, reader=None, dtype=None):
        super()._apply_plan(resolved, distributed_config, reader=reader, dtype=dtype)
        self._set_local_heads()
        if self.parallel.cp is not None:  # masks and attention through hf/attention.py
            use_tptrain_attention(self, contract.sequence_entry(self) or "")
        return self

    def _set_local_heads(self) -> None:
        """transformers' attention repeats KV heads `num_key_value_groups` times: make it this rank's ratio of
        query heads to KV heads (with KV replicas, fewer KV heads per rank than transformers assumes)."""
        for name, module in self.named_modules():
            query, kv = getattr(module, "tp_query_projection", None), contract.kv_projections(module)
            if query is None or not kv:
                continue
            head_dim = module.head_dim
            local_q = getattr(module, query).weight.shape[0] // head_dim
            local_kv = getattr(module, kv[0]).weight.shape[0] // head_dim
            assert local_q % local_kv == 0, (name, local_q, local_kv)
            module.num_key_value_groups = local_q // local_kv

    # ------------------------------------------------------------------ running

    def get_input_embeddings(self) -> nn.Module:
        return self.hf_model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.hf_model.get_output_embeddings()

    def gradient_checkpointing_enable(self) -> None:
        """transformers' own activation checkpointing of each decoder layer (non-reentrant)."""
        self.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": self._packed.checkpoint_contexts})  # a packed batch's documents

    def train(self, mode: bool = True) -> "TransformersCausalLM":
        super().train(mode)
        self.hf_model.training = mode
        return self

    def forward(self, input_ids: torch.Tensor, *, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                num_items_in_batch: int | torch.Tensor | None = None, per_sequence: bool = False,
                per_token: bool = False, temperature: float = 1.0, **kwargs: Any) -> CausalLMOutput:
        """transformers' forward for the logits (vocab-sharded under TP with labels, or sampled by the generation
        engine); tptrain's loss (`per_sequence`: each row's summed token loss, (batch,); `per_token`: each position's,
        (batch, seq); `temperature`: of the logits the loss reads, as TRL's GRPO scores completions). Without `use_cache` (or a
        cache given in `past_key_values`) no cache is made; with it transformers' own cache (its DynamicCache, each
        rank's KV heads) is returned in `past_key_values`."""
        kwargs.setdefault("use_cache", kwargs.get("past_key_values") is not None)
        cp = self.parallel.cp
        documents = self._packed.of_forward(input_ids.shape[0], position_ids, attention_mask, cp, kwargs)
        if cp is not None and attention_mask is None:
            # this rank's position ids jump between its two chunks: no packing for transformers to find in them (the
            # masks come from the whole batch's, hf/attention.py)
            attention_mask = torch.ones_like(input_ids)
        masks_over = None if kwargs["use_cache"] or kwargs.get("past_key_values") is not None else position_ids
        with running(getattr(self, self.base_model_prefix), cp, masks_over), self._packed.running(documents):
            out = self.hf_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                **kwargs)
        scores = out.logits if temperature == 1.0 else out.logits / temperature
        loss = None if labels is None else self.loss_function(scores, labels, num_items_in_batch,
                                                              per_sequence=per_sequence, per_token=per_token)
        return CausalLMOutput(loss=loss, logits=out.logits, past_key_values=getattr(out, "past_key_values", None))

    # ------------------------------------------------------------------ saving

    def config_json(self, dtype: torch.dtype) -> str:
        """transformers' own config.json, with the saved dtype."""
        config = self.config.to_dict()
        config["dtype"] = dtype_name(dtype)
        config["architectures"] = [type(self.hf_model).__name__]
        return json.dumps(self.config._encode_special_floats(config), indent=2, sort_keys=True) + "\n"
