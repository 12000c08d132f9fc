"""The `tptrain` command: `tptrain plan` (a dry run of a tensor-parallel layout) and `tptrain train`.

    tptrain plan Qwen/Qwen3-0.6B --tp-size 4                  # or a checkpoint directory
    tptrain plan ./ckpt --tp-size 8 --sequence-parallel --dtype bfloat16
    tptrain plan ./qwen3-moe --tp-size 2 --ep-size 4               # experts over 4 ranks, attention TP 2
    tptrain plan ./ckpt --tp-size 2 --tp-plan '{"layers.*.mlp.down_proj": "rowwise"}'
    tptrain plan ./llama --tp-size 2 --backend transformers   # transformers' model code on tptrain's engine
    tptrain plan ./ckpt --train --world 8 --device h100 --batch-size 2 --seq-len 8192 --bf16   # the layout to train with
    python -m tptrain plan ...                                # the same
    tptrain train --help
    tptrain prepare-data --model ./ckpt --data corpus.txt     # tokenize into the token cache before training
    tptrain generate --model ./ckpt --prompt "To be" --tp-size 2   # continue prompts (cli/generate.py)
    tptrain --version

`plan` exits 0 when the layout works, 2 when the plan is impossible (the report lists every problem), 1
when the config cannot be read or the rule table (tptrain/layout) refuses the layout, with the message
`from_pretrained` gives; `plan --train` (cli/plan_train.py) exits 0 when a layout fits, 2 when none does.
`train` lives in tptrain/cli/train.py and is imported only when it
is the command, so `plan` works without the training stack.
"""
from __future__ import annotations

import argparse
import json
import sys
from types import ModuleType
from typing import Sequence

from tptrain.backends import BACKENDS
from tptrain.dtypes import NAMES, canonical_name
from tptrain.cli.generate import add_generate_arguments
from tptrain.cli.plan_train import add_train_plan_arguments, check_train_arguments, run_train_plan


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train = None
    if argv[:1] in (["train"], ["dpo"]):
        try:
            from tptrain.cli import train
        except ImportError as exc:
            return _fail(argv[0], f"the training stack cannot be imported ({type(exc).__name__}: {exc})")
    args = _parser(train).parse_args(argv)
    if train is not None:  # the flags given override a run file's values (--config): it reads them from argv
        return train.run_train(args, argv[1:])
    return args.handler(args)


def _parser(train: ModuleType | None) -> argparse.ArgumentParser:
    """`train`'s own flags are added only when it is the command (`train` is tptrain.cli.train then)."""
    from tptrain import __version__

    parser = argparse.ArgumentParser(prog="tptrain", description="Tensor-parallel training of Hugging Face-format "
                                                                 "decoder LLMs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,train,dpo,generate,prepare-data}")
    plan = sub.add_parser("plan", help="dry-run a tensor-parallel layout: shards, bytes per rank, problems",
                          description="Print how MODEL would be split at --tp-size, without starting any process: "
                                      "each module's style, each parameter's global and per-rank shape, parameter "
                                      "bytes per rank, and every divisibility problem (exit code 2 if any).")
    plan.add_argument("model", help="checkpoint directory or hub id (only config.json is read)")
    plan.add_argument("--tp-size", type=int, default=None, help="tensor-parallel degree (required without --train)")
    plan.add_argument("--sequence-parallel", action="store_true", help="shard norms along the sequence too")
    plan.add_argument("--expert-parallel", action="store_true",
                      help="split a mixture-of-experts model's experts by expert over the TP ranks (ep_size = tp_size)")
    plan.add_argument("--ep-size", type=int, default=None,
                      help="split the experts by expert over an ep axis of that many data-parallel ranks, each expert "
                           "over the TP ranks (DistributedConfig(ep_size=))")
    plan.add_argument("--cp-size", type=int, default=None,
                      help="context parallelism: each sequence split over that many ranks (what it splits, and "
                           "whether the model can)")
    plan.add_argument("--pp-size", type=int, default=None,
                      help="pipeline stages: print each pp rank's stages, their layers and parameter bytes per rank")
    plan.add_argument("--pp-schedule", default="1F1B",
                      help="the pipeline schedule the stages are cut for (Interleaved1F1B, ZBVZeroBubble: two per rank)")
    plan.add_argument("--tp-plan", type=_json_object, default=None,
                      help='JSON {module-glob: style} overrides of the model\'s plan (null removes a rule), e.g. '
                           '\'{"layers.*.mlp.down_proj": "rowwise"}\'')
    plan.add_argument("--backend", choices=BACKENDS, default="auto",
                      help="model code: tptrain's own (native), transformers' under tptrain's engine (transformers, "
                           "needs `pip install \"tptrain[hf]\"`), or auto: native for tptrain's model types")
    plan.add_argument("--dtype", default=None, choices=NAMES, type=canonical_name,
                      help="dtype for the byte counts (default: the config's torch_dtype; with --train float32, as "
                           "tptrain train)")
    add_train_plan_arguments(plan)
    plan.set_defaults(handler=_run_plan, plan_parser=plan)
    _add_prepare_data(sub)
    add_generate_arguments(sub.add_parser(
        "generate", help="continue prompts with a checkpoint over tensor-parallel ranks (model.generate)",
        description="Continue --prompt / --prompts with MODEL laid out over --tp-size ranks (the ones past it "
                    "data-parallel), with a KV cache; greedy unless --do-sample. Rank 0 prints the continuations."))
    train_parser = sub.add_parser("train", help="train a model with tensor parallelism (tptrain train --help)")
    dpo_parser = sub.add_parser("dpo", help="preference tuning: DPO, its loss types, SimPO, ORPO on preference pairs "
                                            "(tptrain dpo --help)")
    if train is not None:
        from tptrain.cli.dpo import add_dpo_arguments

        train.add_train_arguments(train_parser)
        add_dpo_arguments(dpo_parser)
    return parser


def _add_prepare_data(sub) -> None:
    prepare = sub.add_parser("prepare-data", help="tokenize a data file into the token cache before training",
                             description="Tokenize DATA once with MODEL's tokenizer into the token cache that "
                                         "`tptrain train --data DATA` then memory-maps on every rank (a hit if it is "
                                         "there already). The cache does not depend on --seq-len, --packing or "
                                         "--truncation.")
    prepare.add_argument("--model", required=True, help="checkpoint directory or hub id (its tokenizer and config)")
    prepare.add_argument("--data", required=True, help="the .txt or .jsonl file `tptrain train --data` will read")
    prepare.add_argument("--data-cache", metavar="DIR", default=None,
                         help="the cache root (default: $TPTRAIN_CACHE, else ~/.cache/tptrain/data)")
    prepare.add_argument("--chat-template", metavar="FILE", help="Jinja chat template for \"messages\" records")
    prepare.add_argument("--assistant-only-loss", action=argparse.BooleanOptionalAction, default=True,
                         help="as `tptrain train --assistant-only-loss` (part of a .jsonl file's cache key)")
    prepare.set_defaults(handler=_run_prepare_data)


def _run_prepare_data(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tptrain.io import resolve_checkpoint
    from tptrain.models import AutoConfig
    from tptrain.text import load_tokenizer
    from tptrain.training.sft_data import cache_store

    try:
        data = Path(args.data).expanduser()
        if not data.is_file():
            raise FileNotFoundError(f"--data {data} is not a file; pass a .txt or .jsonl file")
        model_dir = resolve_checkpoint(args.model)
        store = cache_store(data, load_tokenizer(model_dir), model_dir=model_dir, chat_template=args.chat_template,
                            assistant_only_loss=args.assistant_only_loss, cache_dir=args.data_cache,
                            vocab_size=AutoConfig.from_pretrained(model_dir).vocab_size)
        if store is None:
            raise OSError("nothing was cached (see above); pass --data-cache DIR")
    except (OSError, ValueError, TypeError) as exc:
        return _fail("prepare-data", str(exc))
    meta = store.meta
    print(f"{store.directory}: {meta['num_tokens']:,} tokens ({meta['dtype']}) in {meta['num_documents']:,} "
          f"{'documents' if meta['kind'] == 'text' else 'records'}")
    return 0


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object {{module-glob: style}}, got {text!r}")
    return value


def _run_plan(args: argparse.Namespace) -> int:
    from tptrain.diagnostics.plan_report import plan_report
    from tptrain.layout import Asked, Spelling, check

    usage = check_train_arguments(args) if args.train else (
        None if args.tp_size is not None else "the following arguments are required: --tp-size (or --train)")
    if usage:
        args.plan_parser.error(usage)
    try:
        if not args.train:  # the sizes as this command spells them (--tp-size), as `tptrain train` checks them
            check("positive", asked=Asked(tp_size=args.tp_size, cp_size=args.cp_size, ep_size=args.ep_size,
                                          pp_size=args.pp_size), spelling=Spelling(cli=True))
        config = _config(args.model, args.backend)
        if args.train:
            return run_train_plan(args, config)
        report = plan_report(config, args.tp_size, tp_plan=args.tp_plan or "auto",
                             sequence_parallel=args.sequence_parallel, expert_parallel=args.expert_parallel,
                             ep_size=args.ep_size or 1, dtype=args.dtype, cp_size=args.cp_size or 1,
                             pp_size=args.pp_size or 1, pp_schedule=args.pp_schedule)
    except (OSError, ValueError, TypeError) as exc:
        return _fail("plan", str(exc))
    print(report.text, end="")
    return 2 if report.problems else 0


def _config(model: str, backend: str):
    """The checkpoint's config: transformers' image-text-to-text one for a vision-language model (a `vision_config`
    of such a type), else tptrain's AutoConfig's."""
    from tptrain.models import AutoConfig, AutoModelForImageTextToText
    from tptrain.models.configuration import load_config_dict
    from tptrain.models.registry import vision_language

    if vision_language(load_config_dict(model)):
        return AutoModelForImageTextToText.config(model)
    return AutoConfig.from_pretrained(model, backend=backend)


def _fail(command: str, message: str) -> int:
    print(f"tptrain {command}: error: {message}", file=sys.stderr)
    return 1
