"""`tptrain train`'s fine-tuning options: instruction data, evaluation, LoRA, logging.

    tptrain train --model ./ckpt --data chat.jsonl --eval-split 0.05 --eval-steps 50 --save-best \
        --lora-r 16 --lora-alpha 32 --lora-dropout 0.05 --lora-target-modules all-linear --merge --tp-size 2

cli/train_arguments.py adds these flags to its --help sections, and cli/train.py calls in here at four points
(preflight, TrainingArguments, LoRA at the start and at the end of a run), so the launcher stays one file and
this concern another.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

def add_finetune_arguments(sections: dict[str, argparse._ArgumentGroup]) -> None:
    """The fine-tuning flags, each in its --help section of `tptrain train` (train_arguments.SECTIONS)."""
    data, evaluation, optimisation = sections["data"], sections["evaluation"], sections["optimisation"]
    data.add_argument("--packing", action=argparse.BooleanOptionalAction, default=None,
                      help="instruction data: pack whole samples into --seq-len rows, each attending only to itself "
                           "(the default, but for a vision-language model's image-text rows, which are never "
                           "packed); --no-packing: one sample per row, padded to the longest in the batch")
    data.add_argument("--assistant-only-loss", action=argparse.BooleanOptionalAction, default=True,
                      help="\"messages\" records: train on the assistant turns only (default)")
    data.add_argument("--chat-template", metavar="FILE", help="Jinja chat template for \"messages\" records "
                                                               "(default: the checkpoint's)")
    data.add_argument("--truncation", choices=("truncate", "error"), default="truncate",
                      help="a sample longer than --seq-len is cut (default; the count is reported) or an error")
    data.add_argument("--data-cache", metavar="DIR", default=None,
                      help="where --data / --eval-data files are tokenized once and memory-mapped by every rank "
                           "(default: $TPTRAIN_CACHE, else ~/.cache/tptrain/data; `tptrain prepare-data` fills it)")
    evaluation.add_argument("--eval-data", metavar="FILE", help="evaluation set (the same formats as --data)")
    evaluation.add_argument("--eval-split", type=float, default=0.0, metavar="FRACTION",
                            help="hold out this fraction of --data for evaluation, e.g. 0.05")
    evaluation.add_argument("--eval-steps", type=int, default=0, metavar="N",
                            help="evaluate every N steps (default 0: only at the end); eval_loss/eval_ppl in "
                                 "metrics.jsonl")
    evaluation.add_argument("--save-best", action="store_true",
                            help="keep the model (or adapter) with the lowest eval loss in --output-dir/best")
    optimisation.add_argument("--num-epochs", type=float, help="passes over the data, instead of --max-steps")
    optimisation.add_argument("--grad-accum", type=int, default=1,
                              help="micro-batches per optimizer step (default: 1)")
    sections["checkpoints and output"].add_argument(
        "--report-to", choices=("none", "tensorboard", "wandb"), default="none",
        help="also log to TensorBoard (--output-dir/runs; needs `pip install tensorboard`) or to a Weights & Biases "
             "run with the resolved configuration (needs `pip install wandb`; $WANDB_MODE=offline: no network)")
    _lora_arguments(sections["LoRA"])


def _lora_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--lora-r", type=int, default=0, help="train a LoRA adapter of this rank (0: full fine-tuning)")
    g.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale alpha / r (default: 2 x --lora-r)")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input (default: 0)")
    g.add_argument("--lora-target-modules", default=None,
                   help="'all-linear' (the default without --lora-target-parameters) or comma-separated module names, "
                        "e.g. q_proj,v_proj")
    g.add_argument("--lora-target-parameters", default=None,
                   help="comma-separated parameter names (peft's target_parameters), e.g. the MoE experts: "
                        "mlp.experts.gate_up_proj,mlp.experts.down_proj")
    g.add_argument("--merge", action="store_true",
                   help="with --lora-r: also write the merged full checkpoint to --output-dir/final/merged")


def training_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainingArguments fields these flags set."""
    return dict(num_train_epochs=args.num_epochs, gradient_accumulation_steps=args.grad_accum, packing=args.packing,
                assistant_only_loss=args.assistant_only_loss, truncation=args.truncation,
                chat_template=args.chat_template, eval_steps=args.eval_steps, eval_split=args.eval_split,
                save_best=args.save_best, report_to=None if args.report_to == "none" else args.report_to,
                data_cache_dir=args.data_cache)


def preflight(args: argparse.Namespace, model_dir: Path, *, max_steps_given: bool, vision: bool = False,
              data: bool = True) -> None:
    """Checks before any worker starts: the data options (the Trainer's own checks), the tokenizer, the data files
    (records parsed, chat template present when a record is a chat; a vision-language model's: cli/vision.py; not
    with `data` False: `tptrain dpo` checks its own), LoRA's values. Raises the first problem found."""
    from tptrain.cli import vision as vision_cli

    _check_data_options(args)
    if vision:
        vision_cli.preflight(args, model_dir)
    else:
        _check_text_data(args, model_dir, files=data)
    if args.num_epochs is not None and max_steps_given:
        raise ValueError("pass --max-steps or --num-epochs, not both")
    if args.lora_r < 0:
        raise ValueError(f"--lora-r must be >= 1 (or 0: no LoRA), got {args.lora_r}")
    if not args.lora_r and (args.merge or args.lora_alpha is not None):
        raise ValueError("--merge and --lora-alpha need --lora-r (a LoRA run)")
    if not args.lora_r and args.lora_target_parameters:
        raise ValueError("--lora-target-parameters needs --lora-r (a LoRA run)")
    if args.lora_r:
        lora_config(args)  # its own checks (e.g. --lora-dropout with --lora-target-parameters), before any worker


def _check_text_data(args: argparse.Namespace, model_dir: Path, *, files: bool) -> None:
    from tptrain.text import load_chat_template, load_tokenizer
    from tptrain.training.data import read_documents
    from tptrain.training.sft_data import scan_data_file

    load_tokenizer(model_dir)  # weights without a tokenizer are refused here (a hub id's weights: in the workers)
    for flag, path in (("--data", args.data), ("--eval-data", args.eval_data)):
        if path is None or (flag == "--data" and args.streaming) or not files:
            continue
        if not Path(path).expanduser().is_file():
            read_documents(path)  # raises, naming the path
        if scan_data_file(Path(path).expanduser()):  # streamed: a 1 GB file is never held in memory here
            load_chat_template(model_dir, args.chat_template)


def _check_data_options(args: argparse.Namespace) -> None:
    """The Trainer's checks of its data against its arguments (training/setup.py's stage 2: what a stream, with no
    known length, cannot serve; the eval set's options), on the TrainingArguments these flags make, so the launcher
    and the Trainer say the same; first, --streaming's files and their text column."""
    from tptrain.training.args import TrainingArguments
    from tptrain.training.setup import check_eval_set
    from tptrain.training.streaming import StreamingText, check_streaming

    train = args.data
    if args.streaming:
        train = StreamingText(args.data, text_column=args.text_column)
        train.check()
    training_args = TrainingArguments(output_dir=args.output_dir, **training_kwargs(args))
    check_streaming(training_args, train, args.eval_data)
    check_eval_set(training_args, args.eval_data)


def lora_config(args: argparse.Namespace):
    from tptrain.peft import LoraConfig

    def names(flag: str | None) -> list[str] | None:
        return None if flag is None else [t.strip() for t in flag.split(",") if t.strip()]

    params = names(args.lora_target_parameters)
    targets = args.lora_target_modules or (None if params else "all-linear")
    targets = targets if targets in (None, "all-linear") else names(targets)
    alpha = 2 * args.lora_r if args.lora_alpha is None else args.lora_alpha
    return LoraConfig(r=args.lora_r, lora_alpha=alpha, lora_dropout=args.lora_dropout, target_modules=targets,
                      target_parameters=params)


def apply_lora(model, args: argparse.Namespace):
    """The model with fresh LoRA adapters when --lora-r is set (only they train), else the model."""
    if not args.lora_r:
        return model
    import torch

    from tptrain.peft import get_peft_model

    torch.manual_seed(args.seed)  # the adapters' initial values and dropout stream follow --seed
    return get_peft_model(model, lora_config(args))


def finish(trainer, args: argparse.Namespace) -> Path | None:
    """With --merge: fold the trained adapters in and write final/merged (a full HF checkpoint + tokenizer)."""
    if not (args.lora_r and args.merge):
        return None
    trainer.model = trainer.model.merge_and_unload()
    return trainer.save_model(Path(args.output_dir) / "final" / "merged")
