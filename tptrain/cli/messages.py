"""What `tptrain train` prints (rank 0): the run's first line, and its summary at the end.

    tptrain train: qwen3 initialised at random (seed 0) from .../tiny-qwen3, ... world size 2, tp 2, ...; lr 0.006
    trained to step 300: loss 8.383 -> 5.296 (mean of the last 10 steps); last step 5.416
    done in 171 s. model: runs/default/final  plot: runs/default/loss.png  metrics: runs/default/metrics.jsonl
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path


def announce(args: argparse.Namespace, inputs, model, threads: int) -> None:
    """The first line (rank 0): the model and where it comes from, the data, the layout, threads and lr; after
    an elastic restart, a line before it saying so. `inputs`: what the rank read (train._Inputs)."""
    import torch

    params = sum(math.prod(model.parallel.tp.global_shapes[n]) for n, _ in model.named_parameters())  # tied once
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart:
        print(f"tptrain train: restart {restart} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')} after a "
              f"worker failure: resuming from the latest complete checkpoint in {args.output_dir} (if none, "
              "starting over)", flush=True)
    source = (f"initialised at random (seed {args.seed}) from {args.model}, which has config.json but no weights"
              if inputs.from_scratch else f"loaded from {args.model}")
    print(f"tptrain train: {inputs.config.model_type} {source} ({params / 1e6:.1f}M parameters); "
          f"{_describe_data(inputs.dataset, args)}; "
          f"world size {torch.distributed.get_world_size()}, tp {args.tp_size}"
          + (" (sequence parallel)" if args.sequence_parallel else "")
          + (f", ep {args.ep_size}" if args.ep_size else "") + (f", cp {args.cp_size}" if args.cp_size > 1 else "")
          + (f", pp {args.pp_size}" if args.pp_size > 1 else "")
          + f", {threads} thread"
          f"{'s' * (threads > 1)} per rank; lr {inputs.training_args.learning_rate:g}", flush=True)


def _describe_data(dataset, args: argparse.Namespace) -> str:
    if hasattr(dataset, "num_pairs"):  # preference pairs (training/preference/data.py)
        return f"{dataset.num_pairs:,} preference pairs from {args.data}, up to {args.max_length} tokens each"
    if hasattr(dataset, "num_samples"):  # instruction records (training/sft_data.py)
        rows = f"packed into {len(dataset):,} rows of {args.seq_len}" if dataset.packing else "one per row"
        images = f"{dataset.num_images:,} images, " if hasattr(dataset, "num_images") else ""
        return (f"{dataset.num_samples:,} samples ({images}{dataset.num_tokens:,} target tokens) from {args.data}, "
                f"{rows}")
    if args.streaming:
        return f"streaming {len(dataset.files):,} file(s) of {args.data} in blocks of {args.seq_len}"
    return f"{dataset.num_tokens:,} tokens from {args.data} in {len(dataset):,} blocks of {args.seq_len}"


def summary(args: argparse.Namespace, result, seconds: float, text: str, *, sampled: bool,
            asked: str | None = None) -> None:
    """The run in three lines; the loss figures are those of metrics.jsonl (earlier, resumed steps included),
    so the final figure is the one loss.png's title states. `text`: the greedy continuation of --prompt, or (not
    `sampled`) why the layout could not generate one; `asked`: a vision-language model's prompt (the data's first,
    its images included), `text` its reply."""
    from tptrain.training.reporting import logged_losses, loss_headline, read_metrics

    out = Path(args.output_dir)
    losses = [loss for _, loss in logged_losses(read_metrics(out / "metrics.jsonl"))]
    if losses:
        print(f"trained to step {result.global_step}: {loss_headline(losses)}; last step {losses[-1]:.3f}")
    if result.skipped_steps:  # --on-nonfinite skip
        steps = ", ".join(map(str, result.skipped_steps[:10])) + (", ..." if len(result.skipped_steps) > 10 else "")
        print(f"{len(result.skipped_steps)} step(s) skipped, their loss or gradient norm not finite: {steps}")
    print(f"done in {seconds:.0f} s. model: {result.final_dir}  plot: {out / 'loss.png'}  "
          f"metrics: {out / 'metrics.jsonl'}")
    if sampled and asked is not None:
        print(f"\ngreedy reply to {asked}:\n{text}\n", flush=True)
    elif sampled:
        print(f"\ngreedy continuation of {args.prompt!r}:\n{args.prompt}{text}\n", flush=True)
    else:
        print(f"no greedy continuation of {args.prompt!r}: {text}", flush=True)
