"""DPOConfig: TrainingArguments plus the preference objective's options, with TRL's names and defaults.

    args = DPOConfig(output_dir="run", beta=0.1, loss_type="ipo", max_length=512, per_device_train_batch_size=4)
    DPOTrainer(model=model, args=args, train_dataset="prefs.jsonl").train()
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tptrain.training.args import TrainingArguments
from tptrain.training.preference.names import (BATCH_SORTED_LOSS_TYPES, F_DIVERGENCE_LOSS_TYPES, F_DIVERGENCES,
                                               LOSS_TYPES, REFERENCE_FREE_LOSS_TYPES, TRUNCATION_MODES)
from tptrain.training.preference.objectives import ObjectiveConfig


@dataclass
class DPOConfig(TrainingArguments):
    """What a preference-tuning run is told: every TrainingArguments field, and (TRL 1.16's DPOConfig names and
    defaults; `max_prompt_length`, `rpo_alpha` and `reference_free` as TRL spelled them before 1.0, `simpo_gamma` and
    `cpo_alpha` as trl.experimental's CPOConfig does):

    learning_rate: 1e-6 (TRL's default for DPO).
    beta: the deviation from the reference (DPO's beta; IPO's tau; ORPO's lambda).
    loss_type: one of objectives.LOSS_TYPES, or a list of them added with `loss_weights` (e.g. MPO's
        ["sigmoid", "bco_pair", "sft"]): "sigmoid" (DPO), "hinge", "ipo", "exo_pair", "nca_pair", "robust",
        "bco_pair", "sppo_hard", "apo_zero", "apo_down", "discopop", "sft" (the chosen completions' NLL),
        "sigmoid_norm"; and, alone, the reference-free "simpo" (CPOTrainer's) and "orpo" (ORPOTrainer's).
    loss_weights: one weight per loss type (None: 1.0 each).
    label_smoothing: robust DPO's label-flip probability, in [0, 0.5); EXO's epsilon (> 0); SimPO's smoothing.
    discopop_tau: DiscoPOP's temperature.
    f_divergence_type: "reverse_kl" (DPO), "forward_kl", "js_divergence" or "alpha_divergence" (f-DPO), for the
        losses built on the chosen - rejected score difference; f_alpha_divergence_coef: its alpha.
    rpo_alpha: weight of the chosen completions' NLL added to the loss (RPO): loss type "sft" with this weight.
    reference_free: no reference model: its log-probabilities are taken as 0.
    simpo_gamma: SimPO's target reward margin; cpo_alpha: the NLL term's weight with "simpo" (CPO's default 1.0;
        0 for the SimPO paper's objective).
    router_aux_loss_coef: weight of a mixture-of-experts model's router aux loss (None: the model config's).
    max_length: tokens per sequence (prompt + completion); longer ones cut as `truncation_mode` says ("keep_start",
        or the deprecated "keep_end"); None: not cut. It is the run's seq_len (the layout's checks read it).
    max_prompt_length: a prompt is cut to its last this many tokens first (None: not cut).
    precompute_ref_log_probs: compute the reference's log-probabilities of every pair once, before training (one
        forward per pair, stored beside the data cache), so no reference is held while training;
        precompute_ref_batch_size: pairs per forward of that pass (None: per_device_train_batch_size).
    """

    learning_rate: float = 1e-6
    beta: float = 0.1
    loss_type: str | list[str] | tuple[str, ...] = "sigmoid"
    loss_weights: list[float] | tuple[float, ...] | None = None
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    rpo_alpha: float | None = None
    reference_free: bool = False
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0
    router_aux_loss_coef: float | None = None
    max_length: int | None = 1024
    max_prompt_length: int | None = None
    truncation_mode: str = "keep_start"
    precompute_ref_log_probs: bool = False
    precompute_ref_batch_size: int | None = None
    loss_types: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_length is not None:
            if not isinstance(self.max_length, int) or isinstance(self.max_length, bool) or self.max_length < 2:
                raise ValueError(f"DPOConfig.max_length must be None or an int >= 2, got {self.max_length!r}")
            self.seq_len = self.max_length
        super().__post_init__()
        types = (self.loss_type,) if isinstance(self.loss_type, str) else tuple(self.loss_type)
        if self.rpo_alpha is not None:
            types += ("sft",)
        self.loss_types = types
        self._check_loss_types()
        self._check_options()

    def _check_loss_types(self) -> None:
        types = self.loss_types
        for name in types:
            if name in BATCH_SORTED_LOSS_TYPES:
                raise ValueError(f"DPOConfig.loss_type {name!r} sorts the log-ratios across the batch, so each pair's "
                                 "loss depends on which pairs share its micro-batch (and so on the layout); use a "
                                 f"per-pair loss type: {', '.join(LOSS_TYPES)}")
            if name not in LOSS_TYPES:
                raise ValueError(f"DPOConfig.loss_type {name!r} is not one of {', '.join(LOSS_TYPES)}")
        if not types:
            raise ValueError("DPOConfig.loss_type is empty; give at least one loss type (default 'sigmoid')")
        given = types[:-1] if self.rpo_alpha is not None else types  # rpo_alpha brings its own weight
        if self.loss_weights is not None and len(self.loss_weights) != len(given):
            raise ValueError(f"DPOConfig.loss_weights has {len(self.loss_weights)} weights for the {len(given)} loss "
                             f"types {list(given)}; give one weight per loss type")
        if set(types) & set(REFERENCE_FREE_LOSS_TYPES) and len(types) > 1:
            raise ValueError(f"DPOConfig.loss_type {list(types)}: 'simpo' and 'orpo' are objectives of their own "
                             "(trl.experimental's CPOTrainer and ORPOTrainer), each with its NLL term; give one alone")
        if "exo_pair" in types and self.label_smoothing <= 0:
            raise ValueError("DPOConfig.loss_type 'exo_pair' needs label_smoothing > 0 (EXO's epsilon; the paper "
                             "recommends 1e-3)")
        if self.f_divergence_type not in F_DIVERGENCES:
            raise ValueError(f"DPOConfig.f_divergence_type {self.f_divergence_type!r} is not one of "
                             f"{', '.join(F_DIVERGENCES)}")
        if self.f_divergence_type != "reverse_kl" and not set(types) <= set(F_DIVERGENCE_LOSS_TYPES):
            raise ValueError(f"DPOConfig.f_divergence_type={self.f_divergence_type!r} generalises only the loss types "
                             f"{', '.join(F_DIVERGENCE_LOSS_TYPES)}; got {list(types)}")

    def _check_options(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"DPOConfig.beta must be > 0, got {self.beta!r}")
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ValueError(f"DPOConfig.truncation_mode {self.truncation_mode!r} is not one of "
                             f"{', '.join(TRUNCATION_MODES)}")
        for name in ("max_prompt_length", "precompute_ref_batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"DPOConfig.{name} must be None or an int >= 1, got {value!r}")
        if self.reference_free and self.precompute_ref_log_probs:
            raise ValueError("DPOConfig.reference_free=True takes the reference log-probabilities as 0, so there is "
                             "nothing to precompute: drop precompute_ref_log_probs (--precompute-ref-log-probs) or "
                             "reference_free (--reference-free)")
        if self.precompute_ref_log_probs and not self.needs_reference:
            raise ValueError(f"DPOConfig.precompute_ref_log_probs: loss_type {list(self.loss_types)} reads no "
                             "reference model, so there is nothing to precompute; drop it")

    @property
    def needs_reference(self) -> bool:
        """Whether the run reads reference log-probabilities: not reference-free, not SimPO / ORPO (the NLL term alone
        reads none for its loss, but TRL's rewards/* are still log-ratios to the reference)."""
        return not self.reference_free and not set(self.loss_types) <= set(REFERENCE_FREE_LOSS_TYPES)

    def objective(self) -> ObjectiveConfig:
        weights = None if self.loss_weights is None else tuple(self.loss_weights)
        if self.rpo_alpha is not None:
            weights = (weights or (1.0,) * (len(self.loss_types) - 1)) + (self.rpo_alpha,)
        return ObjectiveConfig(loss_type=self.loss_types, loss_weights=weights, beta=self.beta,
                               label_smoothing=self.label_smoothing, discopop_tau=self.discopop_tau,
                               f_divergence_type=self.f_divergence_type,
                               f_alpha_divergence_coef=self.f_alpha_divergence_coef, simpo_gamma=self.simpo_gamma,
                               cpo_alpha=self.cpo_alpha)
