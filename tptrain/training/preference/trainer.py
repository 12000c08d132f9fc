"""DPOTrainer: preference tuning (DPO and its family, SimPO, ORPO) on the one Trainer, at every layout.

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2))
    args = DPOConfig(output_dir="run", beta=0.1, loss_type="sigmoid", max_length=1024, max_steps=1000)
    DPOTrainer(model=model, args=args, train_dataset="prefs.jsonl").train()       # every rank runs this

    torchrun --nproc-per-node 4 dpo.py       # tp 2 x dp_shard 2; or `tptrain dpo --model DIR --data prefs.jsonl`

A workflow on the Trainer: its data (preference pairs, data.py), its collator (chosen and rejected rows of a pair in
one forward), its loss (objectives.py, in the step's `forward_backward`: step.py) and its reference (reference.py).
Set-up, the layouts, checkpoints and resume, the final model (`final/`, or a LoRA run's adapter) and reporting are
the Trainer's; the step logs TRL's metrics (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
logps/chosen, logps/rejected) beside the loss.
"""
from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from tptrain.distributed.state import state_of
from tptrain.text import load_tokenizer
from tptrain.training.preference.config import DPOConfig
from tptrain.training.preference.data import PreferenceDataset, build_preference_data, collate_pairs
from tptrain.training.preference.reference import ModelReference, NoReference, PrecomputedReference
from tptrain.training.preference.reference_copy import frozen_copy, precompute, reference_forward
from tptrain.training.preference.step import PreferenceStep
from tptrain.training.trainer import Trainer, model_dir
from tptrain.training.setup import refuse_evaluation


class DPOTrainer(Trainer):
    """Trains `model` (laid out at any layout, or a PeftModel of one) on the preference pairs of `train_dataset` (a
    .jsonl file, a list of records, a datasets.Dataset or a PreferenceDataset) with the objective `args` (a DPOConfig)
    names, against `ref_model` (laid out like `model`; None: the base of a LoRA run, else a frozen copy loaded from the
    model's checkpoint, or with `precompute_ref_log_probs` nothing held while training). TRL's names: DPOTrainer(model,
    ref_model, args, train_dataset)."""

    def __init__(self, model: nn.Module, ref_model: nn.Module | None = None, *, args: DPOConfig, train_dataset: Any,
                 tokenizer: Any = None, eval_dataset: Any = None) -> None:
        if not isinstance(args, DPOConfig):
            raise TypeError(f"DPOTrainer needs a DPOConfig (TrainingArguments plus the objective's options), got "
                            f"{type(args).__name__}")
        refuse_evaluation("DPOTrainer", args, eval_dataset)
        _check_reference_available(model, ref_model, args)
        self.ref_model = ref_model
        super().__init__(model, args=args, train_dataset=train_dataset, tokenizer=tokenizer)
        self.reference = self._reference()
        coef = args.router_aux_loss_coef
        aux_coef = getattr(self.inner.config, "router_aux_loss_coef", 0.0) if coef is None else coef
        self.step = PreferenceStep(self.model, args=self.args, mesh=self.mesh, device=self.device,
                                   pipeline=self.pipeline, fsdp=self.fsdp, objective=args.objective(),
                                   reference=self.reference, aux_coef=aux_coef or 0.0)

    # ------------------------------------------------------------------ data

    def _dataset(self, source: Any) -> PreferenceDataset:
        if not isinstance(source, PreferenceDataset) and self.tokenizer is None:
            self.tokenizer = load_tokenizer(model_dir(self.inner))
        a = self.args
        return build_preference_data(source, self.tokenizer, model_dir=model_dir(self.inner), chat_template=a.chat_template,
                                     max_length=a.max_length, max_prompt_length=a.max_prompt_length,
                                     truncation_mode=a.truncation_mode, cache_dir=a.data_cache_dir,
                                     vocab_size=self.inner.config.vocab_size)

    def _batch(self, rows: list[Any]) -> dict[Any, Any]:
        """Pairs collated with their chosen rows first (per pipeline microbatch under pp, every batch then padded
        to max_length: the stages exchange one shape)."""
        groups = self.pipeline.schedule._n_microbatches if self.pipeline is not None else 1
        length = self.args.seq_len if self.pipeline is not None else None
        batch = collate_pairs(rows, groups=groups, length=length, whole_chosen=self.args.objective().whole_chosen_nll,
                              **self._padding())
        return {k: v.to(self.device) for k, v in batch.items()}

    def evaluate(self, eval_dataset: Any = None) -> dict[str, float]:
        raise ValueError("DPOTrainer evaluates no held-out preference set yet (the Trainer's evaluate is a token loss "
                         "over text, not the objective); evaluate the saved model (final/) on its own")

    def _report_truncation(self) -> None:
        data = self.dataset
        if data.num_truncated and self.is_rank0:
            print(f"tptrain: {data.num_truncated} of {len(data)} pairs of {data.name} were longer than max_length="
                  f"{self.args.max_length} and were cut ({self.args.truncation_mode})", flush=True)

    # ------------------------------------------------------------------ the reference

    def _reference(self):
        """The reference this run reads (reference.py); with precompute_ref_log_probs, every pair's computed now."""
        args, model = self.args, self.model
        if not args.needs_reference:
            return NoReference()
        adapters = _is_peft(model) and self.ref_model is None
        if args.precompute_ref_log_probs:  # a given reference laid out on the run's mesh first, or the policy itself
            ref = frozen_copy(self, self.ref_model) if self.ref_model is not None else model
            source = self._reference_of(ref, adapters=adapters, pipeline=self.pipeline if ref is model else None)
            precompute(self, source)
            self.ref_model = None  # TRL frees a given reference once its log-probabilities are computed
            return PrecomputedReference()
        if adapters:
            return self._reference_of(model, adapters=True, pipeline=self.pipeline)
        return self._reference_of(frozen_copy(self, self.ref_model), adapters=False)

    def _reference_of(self, ref: nn.Module, *, adapters: bool, pipeline: Any = None) -> ModelReference:
        if pipeline is None and state_of(_inner(ref)).pp is not None:
            pipeline = ref.pipeline  # a frozen copy's own stages (reference_copy.frozen_copy)
        context = ref.disable_adapter if adapters else contextlib.nullcontext
        return ModelReference(ref, context=context, autocast=self.step.autocast, pipeline=pipeline,
                              run_pipeline=reference_forward)


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def _inner(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _check_reference_available(model: nn.Module, ref_model: nn.Module | None, args: DPOConfig) -> None:
    """Before any collective: an objective reading a reference needs one (ref_model, the base of a LoRA run, the
    policy's checkpoint to load a frozen copy from, or the policy itself before training when precomputed)."""
    if ref_model is model:
        raise ValueError("DPOTrainer: model and ref_model are the same object; omit ref_model (a frozen copy is loaded "
                         "from the model's checkpoint) or pass a second model")
    if ref_model is not None and not args.needs_reference:
        raise ValueError(f"DPOTrainer: loss_type {list(args.loss_types)} (reference_free={args.reference_free}) reads "
                         "no reference model, but ref_model was given; drop it")
    if not args.needs_reference or ref_model is not None or _is_peft(model) or args.precompute_ref_log_probs:
        return
    if getattr(_inner(model), "name_or_path", None) is None:
        raise ValueError(f"DPOTrainer: loss_type {list(args.loss_types)} needs a reference model, and this model has "
                         "no checkpoint to load a frozen copy from: pass ref_model=, set precompute_ref_log_probs=True "
                         "(the model itself before training), train LoRA adapters (the base is the reference), or use "
                         "a reference-free objective (reference_free=True, loss_type 'simpo' or 'orpo')")
