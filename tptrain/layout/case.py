"""What the rule table reads (a Case: the sizes, what the run asks of its axes, the model's facts) and what a rule is.

Every input is a plain value, so the table imports no torch: the model's facts are read from it by
`tptrain.parallel.facts.model_facts`, the features by DistributedConfig / ParallelismConfig / TrainingArguments.
An input left None is not known where the table is checked (the library knows no batch size, `tptrain plan` no
world size): the rules reading it wait for an entry point that knows it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from tptrain.layout.dims import Asked, ParallelDims


@dataclass(frozen=True)
class Features:
    """What a run asks of its axes beyond their sizes; the defaults ask nothing. The training fields are known to
    the Trainer and to `tptrain train` only (None elsewhere)."""

    sequence_parallel: bool = False
    expert_parallel: bool = False  # the experts split by expert over the TP group (enable_expert_parallel)
    pp_schedule: str = "1F1B"
    pp_layers: tuple[tuple[int, ...], ...] | None = None
    device_map: bool = False  # from_pretrained(device_map=) next to a distributed_config
    pp_microbatches: int | None = None  # None: as many as pipeline ranks
    batch_size: int | None = None  # per_device_train_batch_size
    seq_len: int | None = None  # the tokens of a sequence (TrainingArguments.seq_len, or an input's length)
    generation: str | None = None  # model.generate: "cache" (a KV cache) or "recompute" (use_cache=False)


@dataclass(frozen=True)
class ModelFacts:
    """What the rules need to know of a model, as plain values."""

    name: str  # its class, e.g. "Qwen3ForCausalLM"
    model_type: str
    backend: str = "native"
    num_layers: int | None = None  # the decoder layers a pipeline cuts; None: it cannot be cut into stages
    pp_refusal: str | None = None  # why it cannot be cut into stages, if the model says
    sp_refusal: str | None = None  # why its sequence cannot be split over tp (sequence parallelism), if the model says
    attention: int = 1  # attention modules (tp_kv_projections declared)
    without_attend: tuple[str, ...] = ()  # "name (Class)" of attention modules with no attend(q, k, v, mask)
    mask_builder: str | None = None  # the base model lacking attention_masks(...), e.g. "Qwen3Model at 'model'"
    sequence_mixers: tuple[tuple[str, str], ...] = ()  # (module, class) mixing tokens cp cannot split (key indexers)
    whole_sequence: tuple[tuple[str, str], ...] = ()  # (module, class) of mixers cp runs on the whole sequence
    experts: int | None = None  # stacked-experts modules the plan splits (None: not read)
    ep_plan: bool = False  # the config declares base_model_ep_plan (experts split over the TP group)


@dataclass(frozen=True)
class Spelling:
    """How an entry point names the sizes in its errors: the library's keywords (`owner`'s fields), the CLI's
    flags (`cli`), or the axes of a `--layout` text (`layout`: tptrain plan --train, tptrain train --layout).
    `described`: the sizes as a whole (e.g. "ParallelismConfig(tp_size=2 (the model's), ...)"); `processes`: the
    CLI's world ("--nproc-per-node 3"); `seq_len`: what a sequence length is called."""

    owner: str = "DistributedConfig"
    described: str | None = None
    cli: bool = False
    processes: str | None = None
    seq_len: str = "the sequence length"
    layout: str | None = None

    def name(self, size: str) -> str:
        """A size as this entry point spells it: DistributedConfig.tp_size, --tp-size, or tp in --layout 'tp=0'."""
        if self.layout is not None:
            return f"{self.key(size)} in --layout {self.layout!r}"
        return "--" + size.replace("_", "-") if self.cli else f"{self.owner}.{size}"

    def key(self, size: str) -> str:
        """A size's bare keyword: tp_size, or tp in a --layout."""
        return size.removesuffix("_size") if self.layout is not None else size


LIBRARY = Spelling()


@dataclass(frozen=True)
class Case:
    """One layout to check. `asked` and `world`: the sizes as given and the world size (the size rules); `dims`: the
    sizes resolved; `model_axes` / `config_axes`: what the model fixed when it was loaded and what a
    ParallelismConfig asks of the same axes ((name, value) pairs, given ones only)."""

    dims: ParallelDims | None = None
    features: Features = field(default_factory=Features)
    facts: ModelFacts | None = None
    asked: Asked | None = None
    world: int | None = None
    model_axes: tuple[tuple[str, Any], ...] | None = None
    config_axes: tuple[tuple[str, Any], ...] | None = None
    spelling: Spelling = LIBRARY

    def known(self, path: str) -> bool:
        """Whether input `path` ("dims", "facts", "features.seq_len", ...) is known here."""
        value: Any = self
        for part in path.split("."):
            value = getattr(value, part)
            if value is None:
                return False
        return True


@dataclass(frozen=True)
class Rule:
    """One row of the rule table. `check(case, rule)` is the refusal's message, or None when the case passes; it is
    called only when every input in `needs` is known (`refusal`). `between`: the axes and features the rule is about
    (the docs' composition table); empty for a rule on sizes alone. `when`, `reason`, `fix`: the row in words, which
    the message repeats where it can."""

    name: str
    between: tuple[str, ...]
    when: str
    reason: str
    fix: str
    needs: tuple[str, ...]
    check: Callable[[Case, "Rule"], str | None]

    def refusal(self, case: Case) -> str | None:
        """This rule's message for `case` (None: it passes, or an input it needs is not known)."""
        return self.check(case, self) if all(case.known(path) for path in self.needs) else None


def rule(rows: list[Rule], name: str, *, when: str, reason: str, fix: str, needs: tuple[str, ...] = ("dims",),
         between: tuple[str, ...] = ()):
    """Decorator: append the function ((case, rule) -> message or None) to `rows` as the Rule `name`."""
    def register(check: Callable[[Case, Rule], str | None]) -> Callable[[Case, Rule], str | None]:
        rows.append(Rule(name, between, when, reason, fix, needs, check))
        return check
    return register
