"""`tptrain dpo`: preference tuning from the command line: `tptrain train`'s flags, run files and launcher, plus
DPOConfig's fields as flags (a "preference" section), on preference data.

    tptrain dpo --model DIR --data prefs.jsonl --tp-size 2                      # DPO (sigmoid), a frozen reference
    tptrain dpo --model DIR --data prefs.jsonl --tp-size 2 --lora-r 16 --loss-type ipo   # the base is the reference
    tptrain dpo --model DIR --data prefs.jsonl --loss-type simpo --cpo-alpha 0  # SimPO, reference-free
    tptrain dpo --config dpo.yaml                                               # a run file: beta: 0.1, ...

Everything else is `tptrain train`'s (cli/train.py): the up-front checks (here the preference records, each bad one
named by line and field), the workers, checkpoints, --resume, --merge. `--max-length` is the run's --seq-len.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DPO_LR = 1e-6  # TRL's DPOConfig default
# The DPOConfig fields these flags set (their dest is the field's name)
FIELDS = ("beta", "loss_type", "loss_weights", "label_smoothing", "rpo_alpha", "reference_free", "simpo_gamma",
          "cpo_alpha", "f_divergence_type", "f_alpha_divergence_coef", "discopop_tau", "router_aux_loss_coef",
          "max_length", "max_prompt_length", "truncation_mode", "precompute_ref_log_probs",
          "precompute_ref_batch_size")


def add_dpo_arguments(parser: argparse.ArgumentParser) -> None:
    """`tptrain train`'s flags, then the preference objective's (TRL's DPOConfig names, as flags)."""
    from tptrain.cli.train_arguments import add_train_arguments
    from tptrain.training.preference.names import F_DIVERGENCES, LOSS_TYPES, TRUNCATION_MODES

    add_train_arguments(parser)
    g = parser.add_argument_group("preference")
    g.add_argument("--beta", type=float, default=0.1, help="deviation from the reference (DPO's beta; default 0.1)")
    g.add_argument("--loss-type", nargs="+", default=["sigmoid"], choices=LOSS_TYPES, metavar="TYPE",
                   help=f"one loss type or several added with --loss-weights: {', '.join(LOSS_TYPES)} "
                        "(default: sigmoid; simpo and orpo alone)")
    g.add_argument("--loss-weights", nargs="+", type=float, default=None, help="one weight per --loss-type")
    g.add_argument("--label-smoothing", type=float, default=0.0, help="robust DPO / EXO / SimPO smoothing")
    g.add_argument("--rpo-alpha", type=float, default=None, help="add the chosen completions' NLL with this weight")
    g.add_argument("--reference-free", action="store_true", help="no reference model (its log-probabilities 0)")
    g.add_argument("--simpo-gamma", type=float, default=0.5, help="SimPO's target reward margin (default 0.5)")
    g.add_argument("--cpo-alpha", type=float, default=1.0, help="the NLL term's weight with simpo (default 1.0)")
    g.add_argument("--f-divergence-type", default="reverse_kl", choices=F_DIVERGENCES, help="f-DPO's divergence")
    g.add_argument("--f-alpha-divergence-coef", type=float, default=0.5, help="alpha of alpha_divergence")
    g.add_argument("--discopop-tau", type=float, default=0.05, help="DiscoPOP's temperature")
    g.add_argument("--router-aux-loss-coef", type=float, default=None,
                   help="a mixture-of-experts model's router aux loss weight (default: its config's)")
    g.add_argument("--max-length", type=int, default=1024, help="tokens per sequence, prompt + completion (default "
                                                                "1024; the run's --seq-len)")
    g.add_argument("--max-prompt-length", type=int, default=None, help="cut a prompt to its last N tokens first")
    g.add_argument("--truncation-mode", default="keep_start", choices=TRUNCATION_MODES,
                   help="which end of a sequence longer than --max-length is kept (default keep_start)")
    g.add_argument("--precompute-ref-log-probs", action="store_true",
                   help="compute the reference's log-probabilities of every pair once before training (stored beside "
                        "the data cache); no reference is held while training")
    g.add_argument("--precompute-ref-batch-size", type=int, default=None, help="pairs per forward of that pass")
    parser.set_defaults(workflow="dpo")


def fill_defaults(args: argparse.Namespace) -> None:
    """What `tptrain dpo` sets before `tptrain train`'s defaults: the sequence length is --max-length."""
    args.seq_len = args.max_length


def training_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The DPOConfig fields of these flags (a single --loss-type as TRL's string)."""
    values = {name: getattr(args, name) for name in FIELDS}
    if len(values["loss_type"]) == 1:
        values["loss_type"] = values["loss_type"][0]
    return values


def preflight(args: argparse.Namespace, model_dir: Path) -> None:
    """Before any worker: the preference records of --data, each bad one named by file, line and field (chosen or
    rejected missing, identical, a wrong type, plain and conversational mixed, a chat without a template), and what
    DPOTrainer refuses of the options (evaluation, a reference it cannot have)."""
    from tptrain.text import load_chat_template
    from tptrain.training.preference.records import check_records, preference_source

    if args.streaming or args.eval_data is not None or args.eval_split or args.eval_steps or args.save_best:
        raise ValueError("tptrain dpo reads its pairs into the token cache and evaluates no held-out set yet: drop "
                         "--streaming / --eval-data / --eval-split / --eval-steps / --save-best")
    path = Path(args.data).expanduser()
    if path.suffix != ".jsonl" or not path.is_file():
        raise ValueError(f"--data {args.data}: tptrain dpo reads a .jsonl file of preference records (\"prompt\", "
                         "\"chosen\", \"rejected\"; or \"chosen\" and \"rejected\" with the prompt implicit)")
    found = preference_source(path)
    if found is None:
        raise ValueError(f"--data {path}: its first record has no \"chosen\" or \"rejected\" field; tptrain dpo needs "
                         "preference records")
    check_records(*found, chat_template=lambda: load_chat_template(model_dir, args.chat_template))
