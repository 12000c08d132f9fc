"""GRPOConfig: TrainingArguments plus GRPO's options, with TRL 1.16's names and defaults.

    args = GRPOConfig(output_dir="run", num_generations=4, max_completion_length=64, per_device_train_batch_size=8)
    GRPOTrainer(model=model, reward_funcs=[my_reward], args=args, train_dataset="prompts.jsonl").train()
"""
from __future__ import annotations

from dataclasses import dataclass

from tptrain.training.args import TrainingArguments
from tptrain.training.rl.names import LOSS_TYPES, SCALE_REWARDS


@dataclass
class GRPOConfig(TrainingArguments):
    """What a GRPO run is told: every TrainingArguments field, and (TRL 1.16's GRPOConfig names and defaults):

    learning_rate: 1e-6 (TRL's default for GRPO).
    num_generations: completions sampled per prompt (a group; >= 2). per_device_train_batch_size counts
        completions, as in TRL; each prompt's group is generated and trained within one data-parallel rank, so
        num_generations must divide per_device_train_batch_size x gradient_accumulation_steps.
    max_prompt_length: a prompt longer than this many tokens is refused before training, naming its row (TRL before
        1.0 cut it from the left, silently changing the task; TRL 1.16 has no such option). None: no limit.
    max_completion_length: tokens generated per completion at most.
    temperature, top_p, top_k, min_p: the sampling (model.generate's; top_k 0 and top_p 1.0: off). The per-token
        log-probabilities are log_softmax(logits / temperature), as TRL's.
    stop_strings: strings ending a completion (model.generate's `stop_strings`; needs the tokenizer).
    beta: weight of the KL to the reference (k3 estimator); 0 (TRL's default): no reference is held.
    use_bias_correction_kl: the KL term times the ratio to the old policy (TRL 1.16's default: True).
    num_iterations: optimizer steps on each batch of completions (PPO epochs; > 1: the ratio to the log-probabilities
        of the policy that generated them).
    epsilon, epsilon_high: the clip range [1 - epsilon, 1 + epsilon_high] (epsilon_high None: epsilon); cispo's
        upper bound on its ratio is epsilon_high (TRL's advice: 5.0 for cispo).
    loss_type: "dapo" (TRL's default: a token mean over the global batch), "grpo" (a mean per completion, then over
        completions), "dr_grpo" (token sum over completions x max_completion_length), "bnpo" (a token mean per
        micro-batch, so it depends on the micro-batch size, as in TRL), "cispo" (clipped importance weights, detached).
    scale_rewards: advantages divided by the std of their "group" (TRL's default), of the whole "batch", or "none";
        True / False are "group" / "none", as TRL.
    reward_weights: one weight per reward function (None: 1.0 each).
    mask_truncated_completions: completions that reached max_completion_length without eos count in no loss term.
    """

    learning_rate: float = 1e-6
    num_generations: int = 8
    max_prompt_length: int | None = None
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    stop_strings: list[str] | tuple[str, ...] | None = None
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    num_iterations: int = 1
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str | bool = "group"
    reward_weights: list[float] | tuple[float, ...] | None = None
    mask_truncated_completions: bool = False
    router_aux_loss_coef: float | None = None

    def __post_init__(self) -> None:
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        for name in ("max_completion_length", "num_iterations"):
            _check_int(name, getattr(self, name), 1)
        _check_int("num_generations", self.num_generations, 2, why=" (a group's advantages need at least two "
                   "completions to compare)")
        if self.max_prompt_length is not None:
            _check_int("max_prompt_length", self.max_prompt_length, 1)
        self.seq_len = (self.max_prompt_length or 1) + self.max_completion_length  # the layout's checks read it
        super().__post_init__()
        self._check_choices()
        self._check_numbers()
        per_rank = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if per_rank % self.num_generations:
            raise ValueError(f"GRPOConfig.num_generations={self.num_generations} does not divide the completions each "
                             f"data-parallel rank trains per step (per_device_train_batch_size "
                             f"{self.per_device_train_batch_size} x gradient_accumulation_steps "
                             f"{self.gradient_accumulation_steps} = {per_rank}): each prompt's group is generated "
                             "within one rank; make that a multiple of num_generations")

    def _check_choices(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"GRPOConfig.loss_type {self.loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"GRPOConfig.scale_rewards {self.scale_rewards!r} is not one of "
                             f"{', '.join(SCALE_REWARDS)} (or True / False)")
        if self.stop_strings is not None and (isinstance(self.stop_strings, str) or not all(
                isinstance(s, str) and s for s in self.stop_strings)):
            raise ValueError(f"GRPOConfig.stop_strings must be a list of non-empty strings, got {self.stop_strings!r}")

    def _check_numbers(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"GRPOConfig.temperature must be > 0 (completions are sampled), got {self.temperature!r}")
        if self.top_k < 0 or not 0 < self.top_p <= 1 or (self.min_p is not None and not 0 <= self.min_p <= 1):
            raise ValueError(f"GRPOConfig: top_k must be >= 0 (0: off), top_p in (0, 1] (1: off), min_p in [0, 1]; "
                             f"got top_k={self.top_k}, top_p={self.top_p}, min_p={self.min_p}")
        if self.beta < 0 or self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ValueError(f"GRPOConfig: beta, epsilon and epsilon_high must be >= 0, got beta={self.beta}, "
                             f"epsilon={self.epsilon}, epsilon_high={self.epsilon_high}")
        if self.reward_weights is not None and not all(isinstance(w, (int, float)) for w in self.reward_weights):
            raise ValueError(f"GRPOConfig.reward_weights must be numbers, got {self.reward_weights!r}")

    @property
    def upper_epsilon(self) -> float:
        """epsilon_high, or epsilon when not given (TRL's)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def _check_int(name: str, value, least: int, why: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"GRPOConfig.{name} must be an int >= {least}{why}, got {value!r}")
