"""GRPOTrainer: reinforcement learning with verifiable rewards (GRPO, DAPO, Dr. GRPO, BNPO, CISPO) on the one
Trainer, the completions generated on the training shards.

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2))
    args = GRPOConfig(output_dir="run", num_generations=4, max_completion_length=64, per_device_train_batch_size=8)
    GRPOTrainer(model=model, reward_funcs=[has_keyword], args=args, train_dataset="prompts.jsonl").train()

    torchrun --nproc-per-node 4 grpo.py       # tp 2 x dp 2; or `tptrain grpo --model DIR --data ... --reward-funcs m:f`

A workflow on the Trainer: its data (prompts.py), its rollouts (rollout.py: model.generate on the model as it is
laid out, the reward functions, TRL's advantages), its loss (objective.py, in the step's `forward_backward`: step.py)
and, with beta > 0, its reference (the preference workflow's: the LoRA base with the adapters off, or a frozen copy
laid out like the model). Each batch of completions trains num_iterations optimizer steps. Set-up, the layouts,
checkpoints and resume (the prompt order and the generation seeds included), the final model and reporting are the
Trainer's; the step logs TRL's metrics (reward, reward_std, rewards/<func>/mean, completions/*, clip_ratio/*, kl),
and where its time went (time/generation, time/scoring: 0 on a step that reuses a batch; the rest of step_time trains).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import nn

from tptrain.generation import layout_refusal
from tptrain.distributed.state import state_of
from tptrain.text import ByteTokenizer, load_tokenizer
from tptrain.training.nonfinite import StepResult
from tptrain.training.preference.reference import ModelReference
from tptrain.training.preference.reference_copy import frozen_copy
from tptrain.training.rl.config import GRPOConfig
from tptrain.training.rl.prompts import PromptDataset, build_prompts
from tptrain.training.rl.rewards import load_reward_funcs
from tptrain.training.rl.rollout import Rollout, make_rollout
from tptrain.training.rl.step import GRPOStep
from tptrain.training.trainer import Trainer, model_dir
from tptrain.training.setup import refuse_evaluation


class GRPOTrainer(Trainer):
    """Trains `model` (laid out at any layout model.generate runs, or a PeftModel of one) on the prompts of
    `train_dataset` (a .jsonl file, a list of records, a datasets.Dataset or a PromptDataset), rewarded by
    `reward_funcs` (callables `f(prompts, completions, **columns) -> list[float]`, or "module:function" strings),
    with `args` (a GRPOConfig). With beta > 0 the KL is to `ref_model` (laid out like `model`; None: the base of a
    LoRA run, else a frozen copy loaded from the model's checkpoint). TRL's names: GRPOTrainer(model, reward_funcs,
    args, train_dataset)."""

    def __init__(self, model: nn.Module, reward_funcs: Callable | str | Sequence[Callable | str], *,
                 args: GRPOConfig, train_dataset: Any, ref_model: nn.Module | None = None, tokenizer: Any = None,
                 eval_dataset: Any = None) -> None:
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"GRPOTrainer needs a GRPOConfig (TrainingArguments plus GRPO's options), got "
                            f"{type(args).__name__}")
        refuse_evaluation("GRPOTrainer", args, eval_dataset)
        funcs = [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs)
        self.reward_funcs = load_reward_funcs(funcs)
        if args.reward_weights is not None and len(args.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"GRPOConfig.reward_weights has {len(args.reward_weights)} weights for "
                             f"{len(self.reward_funcs)} reward functions; give one weight per function")
        _check_model(model, ref_model, args)
        self.rows_per_item = args.num_generations  # the global batch counts prompts; each makes a group
        self.ref_model = ref_model
        super().__init__(model, args=args, train_dataset=train_dataset, tokenizer=tokenizer)
        self.eos_token_ids, self.pad_token_id = _special_ids(self.inner, self.tokenizer)
        coef = args.router_aux_loss_coef
        aux_coef = getattr(self.inner.config, "router_aux_loss_coef", 0.0) if coef is None else coef
        self.step = GRPOStep(self.model, args=self.args, mesh=self.mesh, device=self.device, pipeline=self.pipeline,
                             fsdp=self.fsdp, aux_coef=aux_coef or 0.0)
        self.reference = self._reference() if args.beta != 0.0 else None
        self.data_order = RepeatedOrder(self.data_order, times=args.num_iterations)
        self.rollout: Rollout | None = None

    # ------------------------------------------------------------------ data

    def _dataset(self, source: Any) -> PromptDataset:
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(model_dir(self.inner))
        a = self.args
        if a.stop_strings and isinstance(self.tokenizer, ByteTokenizer):
            raise ValueError(f"GRPOConfig.stop_strings={list(a.stop_strings)} need the model's tokenizer to spell "
                             f"tokens, and {model_dir(self.inner)} has none (tptrain fell back to bytes): pass "
                             "tokenizer= or drop stop_strings (--stop-strings)")
        data = build_prompts(source, self.tokenizer, model_dir=model_dir(self.inner), chat_template=a.chat_template,
                             max_prompt_length=a.max_prompt_length)
        _check_positions(self.inner, data, a.max_completion_length)
        return data

    def _check_sequence_length(self, dims: Any) -> None:
        """The run's rows (a prompt and its completion) within the model's positions, named by GRPO's options (the
        longest prompt's row is checked once the prompts are read)."""
        limit, a = getattr(self.inner.config, "max_position_embeddings", None), self.args
        if isinstance(limit, int) and a.seq_len > limit:
            prompt = f"max_prompt_length={a.max_prompt_length} + " if a.max_prompt_length else "a prompt + "
            raise ValueError(f"GRPOConfig: {prompt}max_completion_length={a.max_completion_length} reach {a.seq_len} "
                             f"positions, past the model's max_position_embeddings={limit}; lower max_completion_length "
                             "(--max-completion-length) or max_prompt_length (--max-prompt-length)")
        super()._check_sequence_length(dims)

    def training_step(self, indices: list[int]) -> StepResult:
        """One optimizer step: a new batch of completions of this dp rank's prompts `indices` every num_iterations
        steps (generated, scored, their old and reference log-probabilities computed), else the last one again."""
        self.model.train()
        fresh = self.rollout is None or self.rollout.iterations_left == 0
        if fresh:
            self.rollout = make_rollout(self, indices)
            done = self.global_step % self.args.num_iterations  # resumed inside a batch's iterations
            self.rollout.iterations_left -= done
        self.rollout.iterations_left -= 1
        result = self.step(self.rollout.micro, self.optimizer, self.scheduler)
        self.step.metrics.update(self.rollout.metrics)
        self.step.metrics.update({k: v if fresh else 0.0 for k, v in self.rollout.seconds.items()})
        return result

    @property
    def generations(self) -> int:
        """Which batch of completions the next one is (the generation seed's counter): a function of the step."""
        return self.global_step // self.args.num_iterations

    def evaluate(self, eval_dataset: Any = None) -> dict[str, float]:
        raise ValueError("GRPOTrainer evaluates no held-out prompts yet (the Trainer's evaluate is a token loss over "
                         "text); evaluate the saved model (final/) on its own")

    # ------------------------------------------------------------------ the reference

    def _reference(self) -> ModelReference:
        """The KL's reference: a LoRA run's base (adapters off, no second copy), else a frozen copy laid out like
        the model (the preference workflow's)."""
        if self.ref_model is None and hasattr(self.model, "disable_adapter"):
            return ModelReference(self.model, context=self.model.disable_adapter, autocast=self.step.autocast)
        return ModelReference(frozen_copy(self, self.ref_model), autocast=self.step.autocast)


class RepeatedOrder:
    """The Trainer's data order with each batch served `times` times in a row (num_iterations): its state is the
    order's and how many times the current batch was served."""

    def __init__(self, order: Any, *, times: int) -> None:
        self.order, self.times, self.served, self.last = order, times, 0, None

    def next_batch(self) -> list[int]:
        if self.last is None or self.served == self.times:
            self.last, self.served = self.order.next_batch(), 0
        self.served += 1
        return self.last

    def state_dict(self) -> dict[str, Any]:
        return {**self.order.state_dict(), "repeat": {"served": self.served, "last": self.last, "times": self.times}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        repeat = state.pop("repeat", None)
        self.order.load_state_dict(state)
        if repeat is not None and repeat["times"] == self.times:
            self.served, self.last = repeat["served"], repeat["last"]


def _check_model(model: nn.Module, ref_model: nn.Module | None, args: GRPOConfig) -> None:
    """Before any collective: the layout can generate; a KL term has a reference to read."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    refusal = layout_refusal(inner) if state_of(inner).laid_out else None
    if refusal is not None:
        raise ValueError(f"GRPOTrainer generates its completions with the model as it is laid out, which cannot "
                         f"generate: {refusal}")
    if ref_model is model:
        raise ValueError("GRPOTrainer: model and ref_model are the same object; omit ref_model (a frozen copy is "
                         "loaded from the model's checkpoint) or pass a second model")
    if ref_model is not None and args.beta == 0.0:
        raise ValueError("GRPOTrainer: ref_model was given but beta=0 reads no reference; drop it or set beta > 0")
    if args.beta != 0.0 and ref_model is None and not hasattr(model, "disable_adapter") and \
            getattr(inner, "name_or_path", None) is None:
        raise ValueError(f"GRPOConfig.beta={args.beta} needs a reference model, and this model has no checkpoint to "
                         "load a frozen copy from: pass ref_model=, train LoRA adapters (the base is the reference), "
                         "or set beta=0")


def _check_positions(model: nn.Module, data: PromptDataset, max_completion_length: int) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    longest = data.longest
    if isinstance(limit, int) and longest + max_completion_length > limit:
        row = max(range(len(data)), key=lambda i: len(data[i]["prompt_ids"]))
        raise ValueError(f"GRPOConfig.max_completion_length={max_completion_length} after the longest prompt of "
                         f"{data.name} (record {row}, {longest} tokens) reaches {longest + max_completion_length} "
                         f"positions, past the model's max_position_embeddings={limit}; lower max_completion_length "
                         f"(--max-completion-length) to at most {max(limit - longest, 0)} or set max_prompt_length")


def _special_ids(model: nn.Module, tokenizer: Any) -> tuple[tuple[int, ...], int]:
    """The eos ids ending a completion (the checkpoint's generation config, else the model config's, else the
    tokenizer's) and the padding id (pad_token_id, else the first eos)."""
    saved = dict(getattr(model, "generation_config", None) or {})
    eos = saved.get("eos_token_id", getattr(model.config, "eos_token_id", None))
    eos = tokenizer.eos_token_id if eos is None else eos
    eos = (eos,) if isinstance(eos, int) else tuple(eos)
    pad = saved.get("pad_token_id", getattr(model.config, "pad_token_id", None))
    return eos, eos[0] if pad is None else pad
