"""`tptrain generate`: continue prompts with a checkpoint laid out over tensor-parallel ranks (model.generate).

    tptrain generate --model DIR --prompt "To be, or not to be" --tp-size 2
    tptrain generate --model DIR --prompts prompts.jsonl --tp-size 2 --nproc-per-node 4 --do-sample --top-p 0.9 --seed 0
    torchrun --nproc-per-node 2 -m tptrain generate --model DIR --prompt "..." --tp-size 2   # under a launcher

--prompts: a .jsonl file, one {"prompt": ...} per line, the prompt as text or as chat messages (rendered with the
checkpoint's chat template and its generation prompt). Ranks past --tp-size are data-parallel: each takes its share
of the prompts. Rank 0 prints each continuation: plain text for --prompt, one JSON line {"prompt", "completion"} per
prompt, in the file's order, for --prompts. Every problem found before a worker starts (the checkpoint, the sizes,
the prompts file, the settings) ends the command with exit code 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory or hub id")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts", metavar="FILE", help='a .jsonl file of {"prompt": text or chat messages}')
    parser.add_argument("--chat-template", metavar="FILE", help="Jinja chat template for message prompts")
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="processes (default: --tp-size); the ones past it are data-parallel")
    parser.add_argument("--dtype", default="auto", help="weights' dtype (default: the checkpoint's)")
    parser.add_argument("--backend", default="auto", help="model code: auto, native or transformers")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per generate call on a rank")
    g = parser.add_argument_group("generation (transformers' generate arguments)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--do-sample", action="store_true", help="sample (default: the most likely token)")
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-k", type=int, help="0: off (default when sampling: 50, as transformers)")
    g.add_argument("--top-p", type=float)
    g.add_argument("--min-p", type=float)
    g.add_argument("--stop", action="append", dest="stop_strings", help="a stop string (repeatable)")
    g.add_argument("--seed", type=int, default=0, help="the draws' seed (with --do-sample)")
    parser.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    try:
        nproc = _check(args)
    except (OSError, ValueError, TypeError) as exc:
        print(f"tptrain generate: error: {exc}", file=sys.stderr)
        return 2
    if "RANK" in os.environ or nproc == 1:
        return _worker(args, error_dir=None)
    from tptrain.cli.launcher import launch

    args.nnodes, args.max_restarts, args.preemption_grace = 1, 0, 5.0
    return launch(args, nproc, _worker, command="generate")


def _check(args: argparse.Namespace) -> int:
    """Everything that needs no process: the sizes (the rule table's rows), the checkpoint's model type, the prompts
    (read into args.prompt_records), the settings. Returns the processes to start."""
    from tptrain.cli.train import _check_model_type
    from tptrain.layout import Asked, Spelling, check, resolve

    if not args.prompt and not args.prompts:
        raise ValueError("give --prompt TEXT (repeatable) or --prompts FILE.jsonl")
    nproc = args.tp_size if args.nproc_per_node is None else args.nproc_per_node
    spelling = Spelling(cli=True, processes=f"--nproc-per-node {nproc}")
    check("positive", asked=Asked(tp_size=args.tp_size), spelling=spelling)
    resolve(nproc, tp_size=args.tp_size, spelling=spelling)
    for flag in ("batch_size", "max_new_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    args.model_dir = _check_model_type(args.model)
    args.prompt_records = [*args.prompt, *(_read_prompts(Path(args.prompts)) if args.prompts else [])]
    return nproc


def _read_prompts(path: Path) -> list[Any]:
    from tptrain.io import jsonl_records

    if not path.is_file():
        raise FileNotFoundError(f"--prompts {path} is not a file; pass a .jsonl file of {{\"prompt\": ...}} lines")
    prompts = []
    for line, record in jsonl_records(path):
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if not (isinstance(prompt, str) or isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)):
            raise ValueError(f"--prompts {path} line {line}: expected {{\"prompt\": text or a list of chat messages}}, "
                             f"got {json.dumps(record)[:80]}")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"--prompts {path} holds no prompt")
    return prompts


def _worker(args: argparse.Namespace, error_dir: str | None) -> int:
    from tptrain.cli.launcher import worker_started

    rank = os.environ.get("RANK", "0")
    try:
        worker_started(error_dir)
        _generate(args)
        return 0
    except Exception as exc:  # noqa: BLE001 - reported below
        user_error = isinstance(exc, (ValueError, TypeError, OSError))
        message = f"{type(exc).__name__}: {exc}" if user_error else traceback.format_exc()
        if error_dir is None:
            print(f"tptrain generate: error (rank {rank}): {message}", file=sys.stderr)
            return 1
        Path(error_dir, f"rank{rank}.txt").write_text(message)
        sys.exit(1)


def _generate(args: argparse.Namespace) -> None:
    import torch

    from tptrain.distributed import DistributedConfig, comm, init_distributed
    from tptrain.generation import complete
    from tptrain.models import AutoModelForCausalLM
    from tptrain.text import load_tokenizer

    texts = _texts(args)
    tokenizer = load_tokenizer(args.model_dir)
    init_distributed()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=args.dtype, backend=args.backend,
                                                 distributed_config=DistributedConfig(tp_size=args.tp_size))
    dp = torch.distributed.get_world_size() // args.tp_size
    dp_rank = torch.distributed.get_rank() // args.tp_size  # TP innermost
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, stop_strings=args.stop_strings,
                    generator=args.seed + dp_rank if args.do_sample else None)
    mine = list(range(dp_rank, len(texts), dp))  # this dp rank's prompts
    rounds = math.ceil(math.ceil(len(texts) / dp) / args.batch_size)  # the same on every rank: generate is collective
    done: dict[int, str] = {}
    for r in range(rounds):
        batch = mine[r * args.batch_size:(r + 1) * args.batch_size]
        outputs = complete(model, tokenizer, [texts[i] for i in batch or [0]], **settings)
        done.update(zip(batch, outputs))
    gathered = comm.all_gather_object(done)
    if torch.distributed.get_rank() == 0:
        _print({k: v for part in gathered for k, v in part.items()}, texts, args)


def _texts(args: argparse.Namespace) -> list[str]:
    """Each prompt as text: chat messages rendered with the checkpoint's template and its generation prompt."""
    if all(isinstance(p, str) for p in args.prompt_records):
        return list(args.prompt_records)
    from tptrain.text import load_chat_template

    template = load_chat_template(args.model_dir, args.chat_template)
    return [p if isinstance(p, str) else template.text(p, add_generation_prompt=True) for p in args.prompt_records]


def _print(completions: dict[int, str], texts: list[str], args: argparse.Namespace) -> None:
    for i, record in enumerate(args.prompt_records):
        if args.prompts:
            print(json.dumps({"prompt": record, "completion": completions[i]}, ensure_ascii=False), flush=True)
        else:
            print(f"{texts[i]}{completions[i]}\n", flush=True)
