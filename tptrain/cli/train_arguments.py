"""`tptrain train`'s flags, one function per --help section; unset sizes come from the default run (or --smoke-test).

finetune.py adds its flags (instruction data, evaluation, LoRA, logging) to the same sections; run_file.py reads
every one of them from a run file (--config).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from importlib.resources import files

from tptrain.dtypes import NAMES, canonical_name

BUNDLED_MODEL = str(files("tptrain") / "data" / "tiny-qwen3")
BUNDLED_DATA = str(files("tptrain") / "data" / "corpus.txt")
DEFAULT_PROMPT = "Ham.\nTo be, or not to be"
SCRATCH_LR, FINETUNE_LR = 6e-3, 3e-5  # the first is tuned on the bundled 4.2M-parameter model
# The --help sections, in order; "options" (-h) comes first.
SECTIONS = ("run file", "model", "data", "evaluation", "parallelism", "optimisation", "checkpoints and output", "faults",
            "multi-node", "LoRA")


@dataclass(frozen=True)
class _Defaults:
    """The flags a run leaves unset: the embedded default run, and a seconds-long smoke run."""

    max_steps: int
    batch_size: int
    seq_len: int
    save_steps: int
    max_new_tokens: int


FULL = _Defaults(max_steps=300, batch_size=16, seq_len=128, save_steps=100, max_new_tokens=32)
SMOKE = _Defaults(max_steps=4, batch_size=2, seq_len=32, save_steps=2, max_new_tokens=8)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Every `tptrain train` flag, each in its --help section."""
    from tptrain.cli.finetune import add_finetune_arguments

    sections = {title: parser.add_argument_group(title) for title in SECTIONS}
    _run_file(sections["run file"])
    _model(sections["model"])
    _data(sections["data"])
    _parallelism(sections["parallelism"])
    _optimisation(sections["optimisation"])
    _checkpoints(sections["checkpoints and output"])
    _faults(sections["faults"])
    _multi_node(sections["multi-node"])
    add_finetune_arguments(sections)


def fill_defaults(args: argparse.Namespace) -> None:
    """The sizes a run leaves unset, from the default run (or --smoke-test); --warmup-steps from --max-steps.
    With --num-epochs --max-steps stays unset (the Trainer counts the steps once the data is tokenized)."""
    defaults = SMOKE if args.smoke_test else FULL
    args.max_steps_given = args.max_steps is not None
    for name in ("max_steps", "batch_size", "seq_len", "save_steps", "max_new_tokens"):
        if getattr(args, name) is None and not (name == "max_steps" and args.num_epochs is not None):
            setattr(args, name, getattr(defaults, name))
    if args.warmup_steps is None:
        args.warmup_steps = 0 if args.num_epochs is not None else args.max_steps // 10


def _run_file(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--config", metavar="FILE",
                   help="a run file (YAML, or TOML: *.toml) of options, each named as its flag without the dashes "
                        "(max-steps: 300); the flags given on the command line override it")
    g.add_argument("--print-config", action="store_true",
                   help="print every option's final value as a run file (what --output-dir/run_config.yaml "
                        "saves) and exit without training")


def _model(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--model", default=BUNDLED_MODEL,
                   help="checkpoint directory or hub id; a directory without weights (no model.safetensors or its "
                        "index; default: the bundled tiny Qwen3 config) is initialised at random (--seed)")
    g.add_argument("--dtype", default="float32", choices=NAMES, type=canonical_name,
                   help="parameter dtype (default: float32; bf16, fp16, fp32 accepted too)")
    g.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the data order (default: 0)")


def _data(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--data", default=BUNDLED_DATA,
                   help=".txt (documents separated by two blank lines) or .jsonl file: {\"text\": ...}, "
                        "{\"messages\": [...]} or {\"prompt\": ..., \"completion\": ...} per line "
                        "(default: the bundled Shakespeare corpus); with --streaming a directory, file or glob of "
                        ".parquet/.arrow/.jsonl shards")
    g.add_argument("--streaming", action="store_true",
                   help="read --data while training (files in name order, packed on the fly; the position is saved "
                        "in checkpoints) instead of tokenizing it all first; needs --max-steps, not --num-epochs")
    g.add_argument("--text-column", default="text", metavar="NAME",
                   help="with --streaming: the column (or jsonl key) holding the text (default: text)")
    g.add_argument("--seq-len", type=int, help=f"tokens per sequence (default: {FULL.seq_len})")


def _parallelism(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--tp-size", type=int, default=2, help="tensor-parallel degree (default: 2)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="also split the norms and the activations between the tensor-parallel blocks along the "
                        "sequence over the --tp-size ranks (less activation memory, the same losses); --seq-len "
                        "(/ --cp-size) a multiple of --tp-size")
    g.add_argument("--expert-parallel", action="store_true",
                   help="split a mixture-of-experts model's experts by expert over the --tp-size ranks (ep = tp)")
    g.add_argument("--ep-size", type=int, default=None,
                   help="split a mixture-of-experts model's experts by expert over N data-parallel ranks (an ep axis "
                        "of its own; each expert over the --tp-size ranks); --nproc-per-node a multiple of "
                        "N x --tp-size")
    g.add_argument("--cp-size", type=int, default=1,
                   help="context-parallel degree: each sequence split over N ranks (long sequences); --seq-len a "
                        "multiple of 2 x N (default: 1)")
    g.add_argument("--pp-size", type=int, default=1,
                   help="pipeline stages (the model's layers cut into --pp-size stages of --tp-size ranks each)")
    g.add_argument("--pp-schedule", default="1F1B",
                   help="torch.distributed.pipelining schedule: 1F1B (default), GPipe, Interleaved1F1B, "
                        "InterleavedZeroBubble, ZBVZeroBubble, ...")
    g.add_argument("--pp-microbatches", type=int, default=None,
                   help="microbatches each --batch-size batch is split into for the pipeline (default: --pp-size)")
    g.add_argument("--layout", default=None, metavar="auto|tp=2,cp=2,...",
                   help="auto: the fastest layout of --nproc-per-node x --nnodes ranks that fits the device's memory "
                        "(tptrain plan --train), printed before training; or the sizes spelled out (they set "
                        "--tp-size, --cp-size, --pp-size, --ep-size)")
    g.add_argument("--nproc-per-node", type=int, default=None,
                   help="worker processes to start (default: --tp-size x --cp-size x --pp-size); extra ranks become "
                        "FSDP2 data-parallel")


def _optimisation(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--max-steps", type=int, help=f"optimizer steps (default: {FULL.max_steps})")
    g.add_argument("--batch-size", type=int, help=f"sequences per device per step (default: {FULL.batch_size})")
    g.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default: {SCRATCH_LR} for a model trained from scratch, {FINETUNE_LR} "
                        "for a checkpoint with weights)")
    g.add_argument("--warmup-steps", type=int, default=None,
                   help="linear warmup steps (default: 10%% of max steps; 0 with --num-epochs)")
    g.add_argument("--bf16", action="store_true", help="bfloat16 mixed precision (parameters stay in --dtype)")
    g.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="clip the global gradient norm to this; 0: no clipping (default: 1.0)")
    g.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each decoder layer in backward: its activations are not kept (less memory, one "
                        "more forward)")
    g.add_argument("--optim-in-backward", action="store_true",
                   help="step each parameter in backward and free its gradient at once (less memory; needs "
                        "--max-grad-norm 0 and --grad-accum 1; no grad_norm logged)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer (inductor; on CPU it needs a C++ compiler, e.g. g++)")


def _checkpoints(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--output-dir", default="runs/default", help="checkpoints, metrics.jsonl, loss.png, final/")
    g.add_argument("--save-steps", type=int, help=f"resumable checkpoint every N steps, 0: never "
                                                  f"(default: {FULL.save_steps})")
    g.add_argument("--save-total-limit", type=int, default=2, help="resumable checkpoints kept (default: 2)")
    g.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                   help="resume from the latest valid checkpoint in --output-dir, or from CHECKPOINT")
    g.add_argument("--overwrite-output-dir", action="store_true",
                   help="start fresh in an --output-dir that holds an earlier run, deleting its checkpoints and "
                        "metrics (without this or --resume such a directory is refused)")
    g.add_argument("--prompt", default=DEFAULT_PROMPT, help="greedy continuation printed after training")
    g.add_argument("--max-new-tokens", type=int, help=f"length of that continuation (default: {FULL.max_new_tokens})")
    g.add_argument("--smoke-test", action="store_true",
                   help=f"seconds-long run for tests: {SMOKE.max_steps} steps of batch {SMOKE.batch_size} x "
                        f"{SMOKE.seq_len} tokens, unless other flags say otherwise")


def _faults(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--preemption-grace", type=float, default=60.0, metavar="SECONDS",
                   help="on SIGTERM / SIGINT finish the current step, write a checkpoint and exit 0 within this "
                        "many seconds (default: 60)")
    g.add_argument("--max-restarts", type=int, default=0,
                   help="when a rank dies, restart the whole group up to N times; each restart resumes from the "
                        "latest complete checkpoint (default: 0)")
    g.add_argument("--pg-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long a collective waits for a rank that hangs before failing "
                        "(default: $TPTRAIN_PG_TIMEOUT or 600)")
    g.add_argument("--on-nonfinite", default="stop", choices=["stop", "skip"],
                   help="a step whose loss or gradient norm is NaN or inf is never applied; stop: end the run with "
                        "exit code 1, naming the step, the ranks and the first non-finite gradient, with no checkpoint "
                        "or final model written after it (default); skip: go on with the next batch, said in the log")
    g.add_argument("--max-nonfinite-skips", type=int, default=5, metavar="N",
                   help="with --on-nonfinite skip: stop once more than N steps in a row were not finite (default: 5)")
    g.add_argument("--hang-timeout", type=float, default=None, metavar="SECONDS",
                   help="a step running longer than this on some rank ends the job (exit code 124; restarted under "
                        "--max-restarts), naming the ranks that stopped and printing each live rank's Python stack "
                        "(default: 10 x the median step time, at least 60 s, after 3 steps; 0: off)")
    g.add_argument("--async-checkpoint", action="store_true",
                   help="write checkpoints in the background while training continues (costs a copy of each "
                        "rank's shards in memory until written)")


def _multi_node(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--nnodes", type=int, default=1, help="machines in the job, each running this command "
                                                         "(default: 1)")
    g.add_argument("--node-rank", type=int, default=0, help="this machine's rank (--rdzv-backend static only; "
                                                            "c10d assigns ranks itself)")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="the rendezvous every node joins (required with --nnodes > 1)")
    g.add_argument("--rdzv-backend", default="c10d", choices=["c10d", "static"],
                   help="torchrun's rendezvous backend for --nnodes > 1 (default: c10d)")
    g.add_argument("--rdzv-id", default="tptrain", help="job id shared by the nodes (default: tptrain)")
