"""`tptrain grpo`: reinforcement learning with verifiable rewards from the command line: `tptrain train`'s flags, run
files and launcher, plus GRPOConfig's fields as flags (a "grpo" section), on a .jsonl of prompts.

    tptrain grpo --model DIR --data prompts.jsonl --reward-funcs my_rewards:correct --tp-size 2
    tptrain grpo --model DIR --data prompts.jsonl --reward-funcs rewards.py:correct rewards.py:short \\
        --reward-weights 1 0.2 --num-generations 4 --max-completion-length 256 --batch-size 16 --beta 0.04
    tptrain grpo --config grpo.yaml                                            # a run file: num_generations: 8, ...

--batch-size counts completions per device (TRL's per_device_train_batch_size): each step trains
batch-size x grad-accum x dp completions, num_generations per prompt. Everything else is `tptrain train`'s
(cli/train.py): the up-front checks (here the reward functions imported and every prompt read, each bad one named),
the workers, checkpoints, --resume, --merge.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

GRPO_LR = 1e-6  # TRL's GRPOConfig default
LENGTH_FLAG = "--max-completion-length"
# The GRPOConfig fields these flags set (their dest is the field's name)
FIELDS = ("num_generations", "max_prompt_length", "max_completion_length", "temperature", "top_p", "top_k", "min_p",
          "stop_strings", "beta", "use_bias_correction_kl", "num_iterations", "epsilon", "epsilon_high", "loss_type",
          "scale_rewards", "reward_weights", "mask_truncated_completions", "router_aux_loss_coef")


def add_grpo_arguments(parser: argparse.ArgumentParser) -> None:
    """`tptrain train`'s flags, then GRPO's (TRL's GRPOConfig names, as flags)."""
    from tptrain.cli.train_arguments import add_train_arguments
    from tptrain.training.rl.names import LOSS_TYPES, SCALE_REWARDS

    add_train_arguments(parser)
    g = parser.add_argument_group("grpo")
    g.add_argument("--reward-funcs", nargs="+", default=None, metavar="MODULE:FUNCTION",
                   help="reward functions f(prompts, completions, **columns) -> list[float]: an importable module's "
                        "or a .py file's function (rewards.py:correct); required")
    g.add_argument("--reward-weights", nargs="+", type=float, default=None, help="one weight per --reward-funcs")
    g.add_argument("--num-generations", type=int, default=8, help="completions per prompt (default 8)")
    g.add_argument("--max-prompt-length", type=int, default=None,
                   help="refuse (not cut) a prompt longer than this many tokens")
    g.add_argument("--max-completion-length", type=int, default=512, help="tokens per completion (default 512)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0: off)")
    g.add_argument("--top-k", type=int, default=0, help="top-k sampling (default 0: off)")
    g.add_argument("--min-p", type=float, default=None, help="min-p sampling (default: off)")
    g.add_argument("--stop-strings", nargs="+", default=None, help="strings that end a completion")
    g.add_argument("--beta", type=float, default=0.0, help="KL weight to the reference (default 0: none held)")
    g.add_argument("--use-bias-correction-kl", action=argparse.BooleanOptionalAction, default=True,
                   help="the KL term times the ratio to the old policy (TRL's default)")
    g.add_argument("--num-iterations", type=int, default=1, help="optimizer steps per batch of completions")
    g.add_argument("--epsilon", type=float, default=0.2, help="the clip range's lower epsilon (default 0.2)")
    g.add_argument("--epsilon-high", type=float, default=None, help="its upper epsilon (default: --epsilon)")
    g.add_argument("--loss-type", default="dapo", choices=LOSS_TYPES, help="default dapo (TRL's)")
    g.add_argument("--scale-rewards", default="group", choices=SCALE_REWARDS,
                   help="divide the advantages by the std of their group (default), the batch, or none")
    g.add_argument("--mask-truncated-completions", action="store_true",
                   help="completions cut at --max-completion-length count in no loss term")
    g.add_argument("--router-aux-loss-coef", type=float, default=None,
                   help="a mixture-of-experts model's router aux loss weight (default: its config's)")
    parser.set_defaults(workflow="grpo")


def fill_defaults(args: argparse.Namespace) -> None:
    """What `tptrain grpo` sets before `tptrain train`'s defaults: a row is a prompt and its completion."""
    args.seq_len = (args.max_prompt_length or 1) + args.max_completion_length


def config(args: argparse.Namespace, lr: float | None) -> tuple[Any, float]:
    """(GRPOConfig with these flags' fields, the learning rate: --lr, else TRL's default)."""
    import functools

    from tptrain.training.rl import GRPOConfig

    return functools.partial(GRPOConfig, **{name: getattr(args, name) for name in FIELDS}), GRPO_LR if lr is None \
        else lr


def preflight(args: argparse.Namespace, model_dir: Path) -> None:
    """Before any worker: the reward functions imported, every prompt of --data read and tokenized (each bad one
    named by line: no prompt, a wrong type, longer than --max-prompt-length), what GRPOTrainer refuses of the
    options (evaluation, positions past the model's)."""
    from tptrain.text import load_tokenizer
    from tptrain.training.rl.rewards import load_reward_funcs

    if args.streaming or args.eval_data is not None or args.eval_split or args.eval_steps or args.save_best:
        raise ValueError("tptrain grpo reads its prompts up front and evaluates no held-out set yet: drop "
                         "--streaming / --eval-data / --eval-split / --eval-steps / --save-best")
    if not args.reward_funcs:
        raise ValueError("tptrain grpo needs --reward-funcs MODULE:FUNCTION (one or more)")
    load_reward_funcs(args.reward_funcs)
    if args.reward_weights is not None and len(args.reward_weights) != len(args.reward_funcs):
        raise ValueError(f"--reward-weights has {len(args.reward_weights)} weights for {len(args.reward_funcs)} "
                         "--reward-funcs; give one per function")
    dataset(args.data, load_tokenizer(model_dir), model_dir, None, args)


def dataset(source: Any, tokenizer: Any, model_dir: Path, config: Any, args: argparse.Namespace) -> Any:
    from tptrain.training.rl.prompts import build_prompts

    return build_prompts(source, tokenizer, model_dir=model_dir, chat_template=args.chat_template,
                         max_prompt_length=args.max_prompt_length)


def trainer(model: Any, inputs: Any, args: argparse.Namespace) -> Any:
    from tptrain.training.rl import GRPOTrainer

    return GRPOTrainer(model, args.reward_funcs, args=inputs.training_args, train_dataset=inputs.dataset,
                       tokenizer=inputs.tokenizer)
