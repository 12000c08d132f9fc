"""LoraConfig: PEFT's LoRA settings (the subset tptrain implements), validated, and its adapter_config.json.

Target matching follows peft 0.21 exactly, so one config adapts the same modules in both libraries:
a list matches a module whose full name equals an entry or ends with "." + entry; a string is a regex
that must match the full module name; "all-linear" is every nn.Linear except the output layer.
`target_parameters` (peft's spelling for transformers 5's fused MoE experts) matches parameter names the same
way, an experts module offering transformers' names `gate_up_proj` and `down_proj` (see peft/lora_experts.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from tptrain.checks import check_positive_int
from tptrain.peft.lora_experts import FUSED, STACKED, is_experts, is_fused_experts

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
ALL_LINEAR = "all-linear"
BIAS_MODES = ("none", "all", "lora_only")
# peft's default targets for Llama, Qwen2 and Qwen3 when target_modules is None.
DEFAULT_TARGETS = ["q_proj", "v_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]  # what peft's "all-linear" keeps as modules on an MoE model
# peft 0.21's rewrite of transformers 4's MoE module names onto transformers 5's fused expert parameters, per model
# type: {module name: parameter target}. gate and up fuse into one gate_up_proj, adapted at rank 2r (alpha 2x).
# Qwen2-MoE has none: its names match only the shared expert's modules.
_FUSED_GATE_UP = r".*\.gate_up_proj"
PEFT_EXPERT_REWRITES = {
    "qwen3_moe": {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj", "gate": "gate.weight"},
    "olmoe": {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj", "gate": "gate.weight"},
    "mixtral": {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj", "gate": "gate.weight"},
}
SUPPORTED_TYPES = (nn.Linear, nn.Embedding)
# adapter_config.json keys whose non-default values change the math; tptrain refuses them rather than
# silently computing something else.
_UNSUPPORTED = ("use_dora", "lora_bias", "fan_in_fan_out", "layers_to_transform",
                "layers_pattern", "exclude_modules", "trainable_token_indices",
                "layer_replication", "use_qalora", "alora_invocation_tokens", "use_bdlora", "megatron_config")


@dataclass
class LoraConfig:
    """LoRA adapter settings; field names and meanings are peft's.

    r: adapter rank (> 0).
    lora_alpha: the update is scaled by lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).
    lora_dropout: dropout probability on the adapter's input (linear layers only, as in peft).
    target_modules: module names (full name or last components), a regex over full names, or "all-linear";
        None means peft's default for Llama/Qwen ["q_proj", "v_proj"] (none when target_parameters is given).
    target_parameters: parameter names (full or last components), as peft: the MoE experts' fused
        "mlp.experts.gate_up_proj" (gate and up share one A) and "mlp.experts.down_proj", or an nn.Linear's
        "....weight". Needs lora_dropout 0 (peft's lora.ParamWrapper has no dropout).
    rank_pattern, alpha_pattern: {regex: r / lora_alpha} for the targets whose name (a module's, or a targeted
        parameter's full name) ends with a match, as peft (e.g. {r".*\\.gate_up_proj": 2 * r}, what peft writes for
        transformers 4's per-expert target_modules on an MoE model).
    bias: "none", "all" (train every bias) or "lora_only" (train the biases of adapted layers).
    use_rslora: rank-stabilised scaling lora_alpha / sqrt(r).
    modules_to_save: modules trained in full and saved with the adapter (peft matches name suffixes).
    task_type, base_model_name_or_path, inference_mode: recorded in adapter_config.json for peft.
    """

    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    target_modules: list[str] | str | None = None
    target_parameters: list[str] | None = None
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    bias: str = "none"
    use_rslora: bool = False
    modules_to_save: list[str] | None = None
    task_type: str | None = "CAUSAL_LM"
    base_model_name_or_path: str | None = None
    inference_mode: bool = False
    peft_type: str = field(default="LORA", init=False)

    def __post_init__(self) -> None:
        check_positive_int(self.r, "LoraConfig.r", what=" (the adapter rank)")
        if not isinstance(self.lora_alpha, (int, float)) or self.lora_alpha <= 0:
            raise ValueError(f"LoraConfig.lora_alpha must be a positive number, got {self.lora_alpha!r}")
        if not isinstance(self.lora_dropout, (int, float)) or not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"LoraConfig.lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        if self.bias not in BIAS_MODES:
            raise ValueError(f"LoraConfig.bias must be one of {BIAS_MODES}, got {self.bias!r}")
        for what, pattern, ok in (("rank_pattern", self.rank_pattern, lambda v: isinstance(v, int) and v > 0),
                                  ("alpha_pattern", self.alpha_pattern, lambda v: isinstance(v, (int, float)) and v > 0)):
            if not isinstance(pattern, dict) or not all(isinstance(k, str) and ok(v) and not isinstance(v, bool)
                                                        for k, v in pattern.items()):
                raise ValueError(f"LoraConfig.{what} must map regexes to positive numbers (ranks: ints), got {pattern!r}")
            for key in pattern:
                try:
                    re.compile(key)
                except re.error as e:
                    raise ValueError(f"LoraConfig.{what} key {key!r} is not a valid regex: {e}") from e
        if self.target_parameters is not None:
            if isinstance(self.target_parameters, (set, tuple)):
                self.target_parameters = sorted(self.target_parameters)
            if (isinstance(self.target_parameters, str) or not self.target_parameters
                    or not all(isinstance(t, str) and t for t in self.target_parameters)):
                raise ValueError("LoraConfig.target_parameters must be a non-empty list of parameter names (e.g. "
                                 f"['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']), got {self.target_parameters!r}")
            if self.lora_dropout:
                raise ValueError(f"LoraConfig.lora_dropout={self.lora_dropout} with target_parameters: LoRA on a "
                                 "parameter (peft's lora.ParamWrapper) has no dropout; set lora_dropout=0")
        if self.target_modules is None:
            self.target_modules = [] if self.target_parameters else list(DEFAULT_TARGETS)
        if isinstance(self.target_modules, (set, tuple)):
            self.target_modules = sorted(self.target_modules)
        if isinstance(self.target_modules, str):
            try:
                re.compile(self.target_modules)
            except re.error as e:
                raise ValueError(f"LoraConfig.target_modules {self.target_modules!r} is not a valid regex: {e}") from e
        elif (not self.target_modules and not self.target_parameters) or not all(
                isinstance(t, str) and t for t in self.target_modules):
            raise ValueError("LoraConfig.target_modules must be a non-empty list of module names, a regex string or "
                             f"'all-linear', got {self.target_modules!r}")
        if self.modules_to_save is not None and not all(isinstance(m, str) and m for m in self.modules_to_save):
            raise ValueError(f"LoraConfig.modules_to_save must be a list of module names, got {self.modules_to_save!r}")

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (self.r ** 0.5 if self.use_rslora else self.r)

    def rank_and_scaling(self, key: str) -> tuple[int, float]:
        """(r, scaling) of the target named `key`: the first rank_pattern / alpha_pattern key whose regex matches
        the end of `key` at a name boundary (peft's get_pattern_key), else r / lora_alpha."""
        r = next((v for k, v in self.rank_pattern.items() if re.match(rf"(.*\.)?({k})$", key)), self.r)
        alpha = next((v for k, v in self.alpha_pattern.items() if re.match(rf"(.*\.)?({k})$", key)), self.lora_alpha)
        return r, alpha / (r ** 0.5 if self.use_rslora else r)

    # ------------------------------------------------------------------ adapter_config.json

    def to_peft_dict(self) -> dict[str, Any]:
        """adapter_config.json as peft writes it (defaults for the features tptrain does not implement)."""
        out = {"peft_type": self.peft_type, "task_type": self.task_type,
               "base_model_name_or_path": self.base_model_name_or_path, "r": self.r, "lora_alpha": self.lora_alpha,
               "lora_dropout": self.lora_dropout, "bias": self.bias, "use_rslora": self.use_rslora,
               "modules_to_save": self.modules_to_save, "inference_mode": True, "init_lora_weights": True,
               "fan_in_fan_out": False, "use_dora": False, "lora_bias": False, "rank_pattern": self.rank_pattern,
               "alpha_pattern": self.alpha_pattern, "layers_to_transform": None, "layers_pattern": None, "exclude_modules": None,
               "revision": None}
        out["target_modules"] = self.target_modules
        out["target_parameters"] = self.target_parameters
        return out

    def save(self, directory: str | os.PathLike) -> None:
        (Path(directory) / CONFIG_NAME).write_text(json.dumps(self.to_peft_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "LoraConfig":
        """Read a (peft- or tptrain-written) adapter_config.json; refuse settings tptrain cannot reproduce."""
        path = Path(directory) / CONFIG_NAME
        if not path.is_file():
            hint = (" (it holds config.json: that is a full model checkpoint, not an adapter)"
                    if (Path(directory) / "config.json").is_file() else "")
            raise FileNotFoundError(f"{directory} has no {CONFIG_NAME}, so it is not a PEFT adapter directory{hint}; "
                                    "pass the directory written by PeftModel.save_pretrained")
        try:
            raw = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        if raw.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{path} describes a {raw.get('peft_type')} adapter; tptrain loads only LoRA adapters")
        bad = {k: raw[k] for k in _UNSUPPORTED if raw.get(k) not in (None, False, {}, [], "")}
        if bad:
            raise ValueError(f"{path} uses peft features tptrain does not implement: {bad}; "
                             "retrain the adapter without them, or merge it with peft first")
        keys = ("r", "lora_alpha", "lora_dropout", "target_modules", "target_parameters", "rank_pattern", "alpha_pattern",
                "bias", "use_rslora", "modules_to_save",
                "task_type", "base_model_name_or_path")
        return cls(**{k: raw[k] for k in keys if k in raw and not (k.endswith("_pattern") and raw[k] is None)})


def _excluded_by_modules_to_save(config: LoraConfig, name: str) -> bool:
    # peft never puts an adapter inside a module it trains in full.
    return any(re.match(rf"(^|.*\.){m}($|\..*)", name) for m in config.modules_to_save or ())


def matches(config: LoraConfig, name: str) -> bool:
    """Whether module `name` is a LoRA target (peft's check_target_module_exists, minus excluded modules)."""
    if _excluded_by_modules_to_save(config, name):
        return False
    targets = config.target_modules
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return _name_matches(targets, name)


def rewrite_expert_targets(model: nn.Module, config: LoraConfig) -> LoraConfig:
    """`config` as peft 0.21 rewrites it for an MoE model whose type it knows (PEFT_EXPERT_REWRITES): transformers 4's
    module names (a list, or "all-linear" = attention + every MLP name) become target_parameters on the fused
    experts and the router, gate_up_proj at rank 2r / alpha 2 lora_alpha, and leave target_modules (so a dense
    layer's MLP of the same name is not adapted either, as in peft). Other configs are returned unchanged."""
    rewrites = PEFT_EXPERT_REWRITES.get(getattr(getattr(model, "config", None), "model_type", None))
    targets = config.target_modules
    if not rewrites or targets is None or (isinstance(targets, str) and targets.lower() != ALL_LINEAR):
        return config
    names = ATTENTION + list(rewrites) if isinstance(targets, str) else list(targets)
    moved = [n for n in names if n in rewrites]
    if not moved:
        return config
    fused = [n for n, p in rewrites.items() if p == "gate_up_proj"]
    if any(n in moved for n in fused) and not all(n in moved for n in fused):
        raise ValueError(f"LoraConfig.target_modules names {[n for n in fused if n in moved][0]!r} without "
                         f"{[n for n in fused if n not in moved][0]!r}: on {model.config.model_type} both are one fused "
                         f"gate_up_proj (transformers 5), as peft refuses too; name both, or neither")
    params = list(dict.fromkeys([*(config.target_parameters or []), *(rewrites[n] for n in moved)]))
    rank, alpha = dict(config.rank_pattern), dict(config.alpha_pattern)
    if "gate_up_proj" in params:
        rank.setdefault(_FUSED_GATE_UP, 2 * config.r)
        alpha.setdefault(_FUSED_GATE_UP, 2 * config.lora_alpha)
    return dataclasses.replace(config, target_modules=[n for n in names if n not in rewrites],
                               target_parameters=params, rank_pattern=rank, alpha_pattern=alpha)


def resolve_targets(model: nn.Module, config: LoraConfig, *, part: bool = False) -> dict[str, nn.Module]:
    """{module name: module} the adapter wraps. Pure (no collective), so every rank raises the same errors. `part`:
    `model` is one pipeline stage, which may hold none of the targets (the caller checks the whole model)."""
    names = [(n, m) for n, m in model.named_modules() if n]
    experts = [n for n, m in names if is_experts(m)]
    if isinstance(config.target_modules, str) and config.target_modules.lower() == ALL_LINEAR:
        output = getattr(model, "lm_head", None)  # peft excludes the output layer of a causal LM
        # An MoE router is an nn.Linear here but not in transformers 5 (its own module), so peft's "all-linear" (on
        # a model type it does not rewrite, Qwen2-MoE) leaves it out too.
        routers = {f"{n}.gate" for n, m in names if is_experts(getattr(m, "experts", None))}
        found = {n: m for n, m in names if isinstance(m, nn.Linear) and m is not output and n not in routers
                 and not _excluded_by_modules_to_save(config, n)}
    else:
        found = {n: m for n, m in names if matches(config, n)}
    if experts and isinstance(config.target_modules, str) and config.target_modules.lower() != ALL_LINEAR:
        _refuse_per_expert_regex(model, config, experts)
    if not found and config.target_modules and not part:
        raise ValueError(f"LoraConfig.target_modules={config.target_modules!r} matches no module of "
                         f"{type(model).__name__} (module names look like {names[min(5, len(names) - 1)][0]!r}); "
                         "give names such as ['q_proj', 'v_proj'], a regex over full names, or 'all-linear'")
    for name, module in found.items():
        if not isinstance(module, SUPPORTED_TYPES):
            hint = (" (LoRA on the experts: target_parameters=['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'])"
                    if is_experts(module) else "")
            raise ValueError(f"LoRA cannot adapt {name!r}: it is a {type(module).__name__}, and tptrain's LoRA "
                             "supports only nn.Linear and nn.Embedding; narrow target_modules (e.g. end a regex with "
                             f"'(q|k|v|o)_proj'){hint}")
    return found


def _refuse_per_expert_regex(model: nn.Module, config: LoraConfig, experts: list[str]) -> None:
    """A target_modules regex that would match transformers 4's per-expert modules (`mlp.experts.0.gate_proj`,
    Mixtral's `w1`): peft 0.21 probes a regex against them and rewrites it per model type; tptrain refuses rather than
    guess (a list of names is rewritten as peft does: `rewrite_expert_targets`)."""
    hub_names = getattr(getattr(model, "config", None), "expert_checkpoint_names", {}).values()
    hit = [n for n in (f"{experts[0]}.0.{h}" for h in hub_names) if re.fullmatch(config.target_modules, n)]
    if hit:
        raise ValueError(f"LoraConfig.target_modules regex {config.target_modules!r} matches transformers 4's "
                         f"per-expert module {hit[0]!r}, which peft 0.21 rewrites (per model type) into "
                         "target_parameters with rank 2*r for gate_up_proj; tptrain does not guess. Narrow the "
                         "regex to the other modules and write the experts out: "
                         f"{_expert_spelling(config)}")


def _expert_spelling(config: LoraConfig) -> str:
    """The explicit expert targets peft 0.21 derives from transformers 4's names for an MoE model."""
    params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    return (f"target_parameters={params}, rank_pattern={{{_FUSED_GATE_UP!r}: {2 * config.r}}}, "
            f"alpha_pattern={{{_FUSED_GATE_UP!r}: {2 * config.lora_alpha}}}")


def _name_matches(targets: list[str], name: str) -> bool:
    """peft's list matching, for module and parameter names alike: `name` is an entry or ends with "." + one."""
    return name in targets or any(name.endswith(f".{t}") for t in targets)


def resolve_parameter_targets(model: nn.Module, config: LoraConfig, *, part: bool = False
                              ) -> tuple[dict[str, tuple[str, ...]], dict[str, nn.Linear]]:
    """({experts module name: its targeted fused parameters, in FUSED order}, {module name: nn.Linear whose
    `weight` is targeted}) for `target_parameters`, matched as peft does. Pure (no collective); `part` as
    `resolve_targets`."""
    targets = config.target_parameters or []
    experts: dict[str, tuple[str, ...]] = {}
    linear: dict[str, nn.Linear] = {}
    for name, module in model.named_modules():
        if is_experts(module) or is_fused_experts(module):
            hit = tuple(p for p in FUSED if _name_matches(targets, f"{name}.{p}"))
            unfused = [p for p in STACKED[:2] if _name_matches(targets, f"{name}.{p}")]
            if unfused:
                raise ValueError(f"LoraConfig.target_parameters names {name}.{unfused[0]}: transformers 5 (and so peft) "
                                 f"hold the experts' gate and up fused as {name}.gate_up_proj, with one LoRA A for both; "
                                 "target 'mlp.experts.gate_up_proj' instead")
            if hit:
                experts[name] = hit
            continue
        for pname, p in module.named_parameters(recurse=False):
            if not _name_matches(targets, f"{name}.{pname}"):
                continue
            if not (isinstance(module, nn.Linear) and pname == "weight"):
                raise ValueError(f"LoraConfig.target_parameters matches {name}.{pname} ({type(module).__name__}, "
                                 f"shape {tuple(p.shape)}); tptrain's LoRA on parameters supports the MoE experts' "
                                 "gate_up_proj / down_proj and nn.Linear weights")
            linear[name] = module
    if targets and not experts and not linear and not part:
        raise ValueError(f"LoraConfig.target_parameters={targets!r} matches no parameter of {type(model).__name__}; "
                         "for a mixture-of-experts model write ['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']")
    return experts, linear


def modules_to_save(model: nn.Module, config: LoraConfig, *, part: bool = False) -> list[str]:
    """Modules trained in full; peft matches any module name ending with an entry (`part` as `resolve_targets`)."""
    entries = config.modules_to_save or []
    found = [n for n, _ in model.named_modules() if n and any(n.endswith(e) for e in entries)]
    missing = [e for e in entries if not any(n.endswith(e) for n in found)]
    if missing and not part:
        raise ValueError(f"LoraConfig.modules_to_save entries {missing} match no module of {type(model).__name__}")
    # A module inside another saved module is saved with it.
    return [n for n in found if not any(n.startswith(f"{o}.") for o in found)]
