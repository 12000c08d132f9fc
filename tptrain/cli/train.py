"""`tptrain train`: train a model with tensor parallelism from the command line.

    tptrain train                                   # bundled tiny Qwen3 on the bundled corpus, TP 2, CPU
    tptrain train --model PATH --data FILE --tp-size 4 --nproc-per-node 8 --max-steps 1000
    tptrain train --config run.yaml --lr 1e-4       # the options in a run file (cli/run_file.py), a flag over it
    torchrun --nproc-per-node 4 -m tptrain train --tp-size 4 ...   # under an existing launcher
    tptrain train --max-restarts 3 ...              # a dead rank: restart the group, resume the latest checkpoint
    tptrain train --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST0:29400 ...   # the same on every node

Without RANK in the environment and with more than one process wanted, the command starts its own
workers with torch's elastic launcher (one node: rendezvous on 127.0.0.1, a free port; several: c10d
at --rdzv-endpoint); under torchrun it is one of the workers. Ranks beyond the TP degree become FSDP2
data-parallel shards. SIGTERM / Ctrl-C (to the launcher or to every rank) ends the current step, writes
a checkpoint and exits 0 within --preemption-grace seconds.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from tptrain.cli import dpo as dpo_cli
from tptrain.cli import grpo as grpo_cli
from tptrain.cli.plan_train import resolve_train_layout
from tptrain.cli.run_file import apply_run_file, dump, resolved_config, save_run_config
from tptrain.cli.train_arguments import FINETUNE_LR, FULL, SCRATCH_LR, add_train_arguments, fill_defaults

__all__ = ["add_train_arguments", "run_train"]


def run_train(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Entry point of `tptrain train`; returns the process exit code (2: refused before any worker started).
    `argv`: the command line after `train`, whose flags override a run file's values (--config)."""
    try:
        args = apply_run_file(args, argv)
        if _workflow(args):  # `tptrain dpo` / `tptrain grpo` (cli/dpo.py, cli/grpo.py): their sequence length
            _workflow(args).fill_defaults(args)
        fill_defaults(args)
        if args.layout is not None and resolve_train_layout(args):  # --layout: the sizes, before anything else
            return 2
        args.run_config = resolved_config(args)  # saved in --output-dir, and the W&B run's config
        if args.print_config:
            print(dump(args.run_config), end="")
            return 0
        nproc = args.nproc_per_node
        if nproc is None:
            nproc = args.tp_size * max(1, args.cp_size) * args.pp_size
        _check_sizes(args, nproc)
        model_dir = _check_model_type(args.model)  # before torch is imported
        from tptrain.distributed.comm import PG_TIMEOUT_ENV, process_group_timeout
        from tptrain.training.checkpoint.dirs import resume_after_restart

        if args.pg_timeout is not None:  # read by every worker (inherited, or this one under torchrun)
            os.environ[PG_TIMEOUT_ENV] = str(args.pg_timeout)
        process_group_timeout()  # a bad value is refused here, not in every worker
        args.resume, args.overwrite_output_dir = resume_after_restart(args.resume, args.overwrite_output_dir,
                                                                      args.output_dir)  # under torchrun
        _preflight(args, nproc, model_dir)
        if os.environ.get("RANK", "0") == "0":  # the launcher (or rank 0 under torchrun)
            save_run_config(args.run_config, args.output_dir)
    except (OSError, ValueError, TypeError) as exc:
        print(f"tptrain train: error: {exc}", file=sys.stderr)
        return 2
    if "RANK" in os.environ or nproc * args.nnodes == 1:
        return _worker(args, error_dir=None)
    return _launch(args, nproc)


def _workflow(args: argparse.Namespace):
    """`tptrain dpo`'s or `tptrain grpo`'s module (cli/dpo.py, cli/grpo.py: its data, config, checks and trainer),
    which runs through the same launcher; None for `tptrain train`."""
    return {"dpo": dpo_cli, "grpo": grpo_cli}.get(getattr(args, "workflow", "train"))


# ------------------------------------------------------------------ checks before any worker starts


def _check_sizes(args: argparse.Namespace, nproc: int) -> None:
    """The flags' sizes, against each other and the world size: the rule table's size rows, which import nothing
    heavy (tptrain/layout), as every rank resolves them."""
    from tptrain.layout import Asked, Features, Spelling, check, resolve

    sizes = dict(tp_size=args.tp_size, cp_size=args.cp_size, ep_size=args.ep_size, pp_size=args.pp_size)
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in sizes.items() if k == "tp_size" or (v or 1) > 1)
    world = nproc * args.nnodes
    processes = f"--nproc-per-node {nproc}" + (f" x --nnodes {args.nnodes} = {world} processes" if args.nnodes > 1
                                               else "")
    spelling = Spelling(cli=True, described=flags, processes=processes)
    check("positive", asked=Asked(**sizes), spelling=spelling)  # before --nproc-per-node, which they make
    for flag, value in (("--nproc-per-node", nproc), ("--nnodes", args.nnodes),
                        ("--preemption-grace", args.preemption_grace), ("--max-nonfinite-skips", args.max_nonfinite_skips)):
        if not value > 0:
            raise ValueError(f"{flag} must be a positive {'number' * (flag == '--preemption-grace') or 'integer'}, "
                             f"got {value}")
    if args.hang_timeout is not None and not args.hang_timeout >= 0:
        raise ValueError(f"--hang-timeout must be a number of seconds (0: off), got {args.hang_timeout}")
    if args.max_restarts < 0 or not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--max-restarts must be >= 0 (got {args.max_restarts}) and --node-rank in "
                         f"[0, --nnodes {args.nnodes}) (got {args.node_rank})")
    if args.nnodes > 1 and not args.rdzv_endpoint and "RANK" not in os.environ:
        raise ValueError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node "
                         "(HOST: a machine every node can reach, e.g. node 0)")
    resolve(world, features=Features(expert_parallel=args.expert_parallel, pp_schedule=args.pp_schedule),
            spelling=spelling, **sizes)


def _check_model_type(model: str) -> Path:
    """The checkpoint's directory, once its config.json names a model type tptrain can run. Neither torch nor
    transformers is imported for it: an unknown model_type is answered in well under a second, not after seconds
    of imports."""
    from tptrain.io.hub import resolve_checkpoint
    from tptrain.models.configuration import load_config_dict
    from tptrain.models.registry import select_backend, vision_language

    model_dir = resolve_checkpoint(model, config_only=True)  # a hub id: its weights come in the workers
    config = load_config_dict(model_dir)
    if not vision_language(config):  # a vision-language model runs on transformers' code (cli/vision.py)
        select_backend(config.get("model_type"))
    return model_dir


def _preflight(args: argparse.Namespace, nproc: int, model_dir: Path) -> None:
    """Everything else that needs no process group, in a second or two: the model's config and plan, --seq-len,
    the flags, the data file, the output directory. Raises the first problem found."""
    from tptrain.io import writable_error
    from tptrain.training.args import check_seq_len
    from tptrain.training.setup import check_packed_documents, check_run
    from tptrain.training.checkpoint.dirs import earlier_run_error, resolve_resume
    from tptrain.cli import finetune as finetune_cli
    from tptrain.cli import vision as vision_cli

    vision = vision_cli.is_vision(model_dir)
    config = vision_cli.config(model_dir, vision)
    training_args = _training_args(args, from_scratch=_config_only(model_dir))  # the flags it validates
    meta = vision_cli.auto_class(vision).from_config(config, device="meta")  # the rule table, as the workers check it
    length_flag = _workflow(args).LENGTH_FLAG if _workflow(args) else "--seq-len"
    check_run(meta, _distributed_config(args), training_args, nproc * args.nnodes, seq_len_name=length_flag)
    _check_tp_plan(meta, args.tp_size, args.model, sequence_parallel=args.sequence_parallel,
                   expert_parallel=args.expert_parallel, ep_size=args.ep_size or 1)
    check_seq_len(args.seq_len, config, what=length_flag)
    if args.compile:
        from tptrain.distributed import local_device
        from tptrain.training.mesh import compile_error

        error = compile_error("inductor", local_device())
        if error:
            raise ValueError(f"--compile: {error}")
    if _workflow(args):  # the preference records / the prompts and reward functions, each bad one named
        _workflow(args).preflight(args, model_dir)
    packed = finetune_cli.preflight(args, model_dir, max_steps_given=args.max_steps_given, vision=vision,
                                    data=not _workflow(args))  # data, eval, LoRA
    check_packed_documents(meta, packed)  # the rule table's row on the data: packed documents the model can keep apart
    error = writable_error(Path(args.output_dir) / "final")
    if error:
        raise OSError(f"--output-dir {args.output_dir}: {error}")
    error = earlier_run_error(args.output_dir, resume=args.resume, overwrite=args.overwrite_output_dir)
    if error:
        raise ValueError(error)
    with warnings.catch_warnings():  # a fall-back is said once, by the Trainer's rank 0, not by every preflight
        warnings.simplefilter("ignore")
        resolve_resume(args.resume, args.output_dir)


def _distributed_config(args: argparse.Namespace):
    from tptrain.distributed import DistributedConfig
    return DistributedConfig(tp_size=args.tp_size, enable_sequence_parallel=args.sequence_parallel,
                             enable_expert_parallel=args.expert_parallel, ep_size=args.ep_size, cp_size=args.cp_size,
                             pp_size=args.pp_size, pp_schedule=args.pp_schedule)


def _check_tp_plan(meta, tp_size: int, model: str, *, sequence_parallel: bool = False, expert_parallel: bool = False,
                   ep_size: int = 1) -> None:
    """The plan at --tp-size on the meta model (what `tptrain plan` checks): one line, the first problem, and the
    sizes that would work."""
    from tptrain.parallel.plan import check_plan, working_tp_sizes

    try:
        problems = check_plan(meta, "auto", tp_size, sequence_parallel=sequence_parallel,
                              expert_parallel=expert_parallel, ep_size=ep_size).problems
    except ValueError as exc:  # --expert-parallel / --ep-size on a dense model
        raise ValueError(f"{'--expert-parallel' if expert_parallel else '--ep-size'}: {exc}") from None
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        flags = (" --sequence-parallel" * sequence_parallel
                 + (" --expert-parallel" if expert_parallel else f" --ep-size {ep_size}" if ep_size > 1 else ""))
        sizes = working_tp_sizes(meta, "auto", sequence_parallel=sequence_parallel, expert_parallel=expert_parallel,
                                 ep_size=ep_size)
        works = f"; sizes that work: {', '.join(map(str, sizes))}" if sizes else ""
        raise ValueError(f"--tp-size {tp_size}{flags} cannot shard {type(meta).__name__}: {problems[0]}{more}{works}; "
                         f"`tptrain plan {model} --tp-size {tp_size}{flags}` shows the layout")


def _config_only(model_dir: Path) -> bool:
    """A directory without weights (io.weights_file; an adapter file is none): initialised at random, not loaded."""
    from tptrain.io import weights_file
    return weights_file(model_dir) is None


def _training_args(args: argparse.Namespace, *, from_scratch: bool):
    from tptrain.training.args import TrainingArguments
    from tptrain.cli.finetune import training_kwargs

    lr = (SCRATCH_LR if from_scratch else FINETUNE_LR) if args.lr is None else args.lr
    arguments = TrainingArguments
    if _workflow(args):  # the workflow's objective's fields too
        arguments, lr = _workflow(args).config(args, args.lr)
    return arguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
        max_steps=FULL.max_steps if args.max_steps is None else args.max_steps,  # None: --num-epochs counts them
        seq_len=args.seq_len, learning_rate=lr, warmup_steps=args.warmup_steps, lr_scheduler_type="cosine",
        max_grad_norm=args.max_grad_norm, optim_in_backward=args.optim_in_backward,
        weight_decay=0.1, adam_beta2=0.95, save_steps=args.save_steps, save_total_limit=args.save_total_limit,
        seed=args.seed, bf16=args.bf16, gradient_checkpointing=args.gradient_checkpointing,
        torch_compile=args.compile, resume_from_checkpoint=args.resume,
        overwrite_output_dir=args.overwrite_output_dir, async_checkpoint=args.async_checkpoint,
        preemption_grace=args.preemption_grace, on_nonfinite=args.on_nonfinite,
        max_nonfinite_skips=args.max_nonfinite_skips, hang_timeout=_hang_timeout(args.hang_timeout),
        parallelism_config=_parallelism_config(args), **training_kwargs(args))


def _hang_timeout(seconds: float | None) -> float | str | None:
    """--hang-timeout as TrainingArguments.hang_timeout: unset "auto", 0 None (off)."""
    return "auto" if seconds is None else seconds or None


def _parallelism_config(args: argparse.Namespace):
    """The Trainer's view of the flags' layout (the model's, `_distributed_config`, plus the microbatches): the ranks
    past tp x cp x pp are FSDP2 data-parallel (over each stage under pp)."""
    from tptrain.training.args import ParallelismConfig

    return ParallelismConfig(tp_size=args.tp_size, cp_size=args.cp_size, ep_size=args.ep_size, pp_size=args.pp_size,
                             pp_schedule=args.pp_schedule, pp_microbatches=args.pp_microbatches)


# ------------------------------------------------------------------ launcher


def _launch(args: argparse.Namespace, nproc: int) -> int:
    from tptrain.cli.launcher import launch

    return launch(args, nproc, _worker)


# ------------------------------------------------------------------ worker


def _worker(args: argparse.Namespace, error_dir: str | None) -> int:
    """One rank's run. User errors (bad flags, data, sizes) print one line; anything else its traceback."""
    from tptrain.cli.launcher import worker_started
    from tptrain.training.preemption import StopOnSignal
    from tptrain.training.reporting import wandb_run

    rank = os.environ.get("RANK", "0")
    # --report-to wandb: rank 0's W&B run, with the resolved configuration as its config; the Trainer logs to it
    tracker = wandb_run(args.output_dir, args.run_config, enabled=args.report_to == "wandb" and rank == "0")
    try:
        with StopOnSignal(args.preemption_grace), tracker:  # a signal while starting up: the Trainer stops after step 1
            worker_started(error_dir)
            _train(args)
        return 0
    except Exception as exc:  # noqa: BLE001 - reported below, once per distinct message
        user_error = isinstance(exc, (ValueError, TypeError, OSError, FloatingPointError))  # not finite: a message
        message = f"{type(exc).__name__}: {exc}" if user_error else traceback.format_exc()
        if error_dir is None:  # under torchrun (or one process): every rank says it, prefixed
            print(f"tptrain train: error (rank {rank}): {message}", file=sys.stderr)
            return 1
        Path(error_dir, f"rank{rank}.txt").write_text(message)
        sys.exit(1)  # quietly: the launcher prints it


@dataclass
class _Inputs:
    """What one rank reads before the process group starts."""

    model_dir: Path
    from_scratch: bool
    config: Any
    tokenizer: Any
    dataset: Any
    training_args: Any
    eval_dataset: Any = None
    vision: bool = False  # a vision-language model: `tokenizer` is its processor's encoder (cli/vision.py)


def _train(args: argparse.Namespace) -> None:
    import torch

    from tptrain.distributed import init_distributed, raise_on_any_rank
    from tptrain.modeling import resolve_dtype
    from tptrain.cli import finetune as finetune_cli
    from tptrain.cli import vision as vision_cli
    from tptrain.cli.messages import announce, summary
    from tptrain.generation import complete, layout_refusal
    from tptrain.training.memory_check import release_freed_memory
    from tptrain.training.trainer import Trainer

    release_freed_memory()  # before the model is built: its full copy, once sharded, goes back to the OS
    threads = _set_threads(torch)
    start = time.perf_counter()
    inputs, error = None, None
    try:  # one rank's files (e.g. another node's copy) can differ: the outcome is agreed right after the rendezvous
        inputs = _read_inputs(args)
    except Exception as exc:  # noqa: BLE001 - raised on every rank just below
        error = exc
    init_distributed()
    raise_on_any_rank(error)
    dtype = resolve_dtype(args.dtype, inputs.config)
    distributed = _distributed_config(args)
    auto = vision_cli.auto_class(inputs.vision)
    if inputs.from_scratch:  # a bare config: the same seed on every rank gives every rank the same initial weights
        torch.manual_seed(args.seed)
        model = auto.from_config(inputs.config, dtype=dtype).parallelize(distributed)
    else:
        model = auto.from_pretrained(inputs.model_dir, dtype=dtype, distributed_config=distributed)
    rank = torch.distributed.get_rank()
    if rank == 0:
        announce(args, inputs, model, threads)
    model = finetune_cli.apply_lora(model, args)  # --lora-r: only the adapters train
    if _workflow(args):
        trainer = _workflow(args).trainer(model, inputs, args)
    else:
        trainer = Trainer(model=model, args=inputs.training_args, train_dataset=inputs.dataset,
                          tokenizer=inputs.tokenizer, eval_dataset=inputs.eval_dataset)
    result = trainer.train()  # ends with the consolidated model (or adapter) + tokenizer files in output_dir/final
    if result.stopped:
        if rank == 0:
            print(f"tptrain train: stopped by {result.stopped} after step {result.global_step}: checkpoint-"
                  f"{result.global_step} written in {args.output_dir}; continue with the same command and --resume",
                  flush=True)
        return
    finetune_cli.finish(trainer, args)  # --merge: final/merged
    refusal = layout_refusal(trainer.model, use_cache=False)  # pipeline stages cannot generate (final/ can)
    asked = None
    if refusal is None and inputs.vision:  # the reply to the data's first prompt, its images included
        asked, text = vision_cli.sample(trainer.model, inputs.tokenizer, inputs.dataset, args.max_new_tokens)
    else:
        text = refusal or complete(trainer.model, inputs.tokenizer, [args.prompt], max_new_tokens=args.max_new_tokens,
                                   do_sample=False, use_cache=layout_refusal(trainer.model) is None)[0]  # cp, sp
    if rank == 0:
        summary(args, result, time.perf_counter() - start, text, sampled=refusal is None, asked=asked)


def _read_inputs(args: argparse.Namespace) -> _Inputs:
    from tptrain.cli import vision as vision_cli
    from tptrain.io import resolve_checkpoint
    from tptrain.text import load_tokenizer
    from tptrain.training.sft_data import build_training_data

    model_dir = resolve_checkpoint(args.model)
    from_scratch, vision = _config_only(model_dir), vision_cli.is_vision(model_dir)
    training_args = _training_args(args, from_scratch=from_scratch)
    config = vision_cli.config(model_dir, vision)
    if vision:  # image-text records through the checkpoint's processor
        encoder, dataset, eval_dataset = vision_cli.data(args, model_dir, config)
        return _Inputs(model_dir, from_scratch, config, encoder, dataset, training_args, eval_dataset, vision=True)
    tokenizer = load_tokenizer(model_dir)

    def build(source):  # a file: tokenized by local rank 0 into the token cache, mapped by every rank
        if _workflow(args):  # preference pairs, prompts
            return _workflow(args).dataset(source, tokenizer, model_dir, config, args)
        return build_training_data(source, tokenizer, args.seq_len, model_dir=model_dir,
                                   chat_template=args.chat_template, packing=args.packing,
                                   assistant_only_loss=args.assistant_only_loss, truncation=args.truncation,
                                   cache_dir=args.data_cache, vocab_size=config.vocab_size)
    data = args.data
    if args.streaming:
        from tptrain.training.streaming import StreamingText

        data = StreamingText(args.data, text_column=args.text_column)
    return _Inputs(model_dir, from_scratch, config, tokenizer, build(data), training_args,
                   None if args.eval_data is None else build(args.eval_data))


def _set_threads(torch) -> int:
    """cores // local processes, unless OMP_NUM_THREADS says otherwise: ranks must not oversubscribe.
    Returns the count: float results depend on it (it changes how matmuls split their sums)."""
    if "OMP_NUM_THREADS" in os.environ:
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        from tptrain.cli.launcher import cores

        threads = cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, threads))
    return max(1, threads)
