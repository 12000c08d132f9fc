"""`tptrain plan MODEL --train --world N ...`: the layout of N ranks that fits and is fastest (diagnostics/train_plan.py).

    tptrain plan meta-llama/Llama-3.1-8B --train --world 8 --device h100 --batch-size 1 --seq-len 8192 --bf16 \\
        --gradient-checkpointing
    tptrain plan ./ckpt --train --world 4 --gpu-memory 24GB --batch-size 4 --seq-len 2048 --layout tp=2 --json

Exit codes: 0 when a layout fits (the best is marked), 2 when none does (what would is printed) or the rules refuse
the given --layout, 1 for bad input (an unknown device, a config that cannot be read). Imports no training code.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def add_train_plan_arguments(plan: argparse.ArgumentParser) -> None:
    g = plan.add_argument_group("training plan (--train): peak memory per rank and step time of every layout")
    g.add_argument("--train", action="store_true",
                   help="plan a training run: every valid layout of --world ranks (or --layout), its peak memory per "
                        "rank split into parameters, gradients, optimizer states, activations, communication buffers "
                        "and the largest transient, its step time; ranked, the best that fits named")
    g.add_argument("--world", type=int, help="ranks (GPUs) of the run")
    g.add_argument("--batch-size", type=int, help="sequences per data-parallel rank per step (as tptrain train's)")
    g.add_argument("--seq-len", type=int, help="tokens per sequence (as tptrain train's)")
    g.add_argument("--layout", help="one layout, e.g. tp=2,cp=2,pp=2,dp_shard=2,dp_replicate=1,ep=2 (omitted sizes "
                                    "1; dp_shard takes the rest of --world); listed first, the others after it")
    g.add_argument("--device", help="device profile for the step time and the memory: h100, h200, b200, a100-80gb, "
                                    "a100-40gb, l40s, a10g, mi300x, or cpu (this machine, measured); default: cpu, "
                                    "or the visible GPU's")
    g.add_argument("--gpu-memory", help="memory per device, e.g. 80GB or 96GiB (overrides the profile's)")
    g.add_argument("--gradient-checkpointing", action="store_true", help="recompute each decoder layer in backward")
    g.add_argument("--bf16", action="store_true", help="bfloat16 mixed precision (parameters stay in --dtype)")
    g.add_argument("--lora-r", type=int, default=0, help="LoRA adapters of this rank on every linear layer (0: full "
                                                         "fine-tuning)")
    g.add_argument("--optim-in-backward", action="store_true", help="step and free each gradient in backward")
    g.add_argument("--reference", choices=("copy", "adapters", "precomputed"), default=None,
                   help="plan a preference run (tptrain dpo; --batch-size counts pairs, two rows each) with this "
                        "reference: copy (a frozen copy sharded like the model), adapters (LoRA's base) or "
                        "precomputed")
    g.add_argument("--images-per-sample", type=int, default=1,
                   help="a vision-language model's images per sequence (tiles, for families that cut an image into "
                        "tiles); its tower's activations are counted for each")
    g.add_argument("--image-size", type=int, default=None,
                   help="the images' side in pixels (default: the tower's own; needed for towers of any size, such as "
                        "Qwen2.5-VL's)")
    g.add_argument("--pp-microbatches", type=int, default=None, help="microbatches per batch under pp (default: pp)")
    g.add_argument("--json", action="store_true", help="print the plan as JSON (docs/planning.md has the schema)")


def check_train_arguments(args: argparse.Namespace) -> str | None:
    """What the command line lacks or mixes (argparse's usage error), or None."""
    if not args.train:
        return None
    missing = [flag for flag, value in (("--world", args.world), ("--batch-size", args.batch_size),
                                        ("--seq-len", args.seq_len)) if value is None]
    if missing:
        return f"--train needs {', '.join(missing)}"
    given = [flag for flag, value in (("--tp-size", args.tp_size), ("--cp-size", args.cp_size),
                                      ("--pp-size", args.pp_size), ("--ep-size", args.ep_size)) if value is not None]
    if given:
        return f"with --train give the sizes as --layout (e.g. --layout tp=2,cp=2), not {', '.join(given)}"
    return None


def _profile(args: argparse.Namespace):
    from tptrain.diagnostics.device_profiles import device_profile, parse_memory, with_memory

    profile = device_profile(args.device) if args.device else _visible_device()
    return with_memory(profile, parse_memory(args.gpu_memory)) if args.gpu_memory else profile


def _visible_device():
    """The profile of the GPU torch sees (its family by name, an H100's when unknown, with its own memory), else
    this machine's CPU."""
    import torch

    from tptrain.diagnostics.device_profiles import PROFILES, device_profile, with_memory

    if not torch.cuda.is_available():
        return device_profile("cpu")
    name = torch.cuda.get_device_name().lower().replace(" ", "")
    family = next((key for key in PROFILES if key.split("-")[0] in name), "h100")
    return with_memory(PROFILES[family], torch.cuda.get_device_properties(0).total_memory)


def run_train_plan(args: argparse.Namespace, config) -> int:
    """Plan, print (table or JSON), and return the exit code."""
    import torch

    from tptrain.diagnostics.train_settings import TrainSettings
    from tptrain.layout import parse_layout
    from tptrain.diagnostics.model_shapes import ModelShapes
    from tptrain.diagnostics.train_plan import plan_training, what_would_fit
    from tptrain.diagnostics.train_report import plan_json, plan_text
    from tptrain.modeling import resolve_dtype

    profile = _profile(args)
    dtype = resolve_dtype(args.dtype or torch.float32, config)
    rows = 2 if args.reference else 1  # a preference pair is a chosen and a rejected row
    settings = TrainSettings(batch_size=rows * args.batch_size, seq_len=args.seq_len, dtype=dtype, bf16=args.bf16,
                             gradient_checkpointing=args.gradient_checkpointing, lora_r=args.lora_r,
                             optim_in_backward=args.optim_in_backward, pp_schedule=args.pp_schedule,
                             pp_microbatches=args.pp_microbatches, sequence_parallel=args.sequence_parallel,
                             expert_parallel=args.expert_parallel, images_per_sample=args.images_per_sample,
                             image_size=args.image_size, reference=args.reference)
    layout = parse_layout(args.layout, args.world) if args.layout else None
    shapes = ModelShapes.of(config, dtype=dtype)
    if shapes.tower is not None and settings.images_per_sample:
        shapes.tower.tokens(settings.image_size)  # a tower of any size needs --image-size: bad input (exit 1)
    try:
        plan = plan_training(shapes, world=args.world, settings=settings, profile=profile, layout=layout)
    except ValueError as exc:
        print(f"tptrain plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan_json(plan), indent=1) if args.json else plan_text(plan, shapes, model_name=args.model),
          end="\n" if args.json else "")
    if plan.best is not None:
        return 0
    hints = what_would_fit(shapes, args.world, settings, profile)
    print(f"tptrain plan: no layout of {args.world} ranks fits {profile.name}'s memory "
          f"(the smallest peak: {min(p.peak for p in plan.layouts) / 2**30:.1f} GiB per rank, "
          f"{plan.layouts[0].budget / 2**30:.1f} GiB available); "
          + ("what would fit: " + "; ".join(hints) if hints else "nothing tried fits (more ranks stop lowering the peak)"),
          file=sys.stderr)
    return 2


def resolve_train_layout(args: argparse.Namespace) -> bool:
    """`tptrain train --layout auto` (the fastest layout that fits, by the plan) or `--layout tp=2,cp=2,...`: sets
    --tp-size, --cp-size, --pp-size and --ep-size from it, before any worker starts, and prints the choice. The world
    is --nproc-per-node (default: the visible GPUs) x --nnodes; every layout computes the same losses, so the choice
    changes speed and memory only. Returns True (after printing the error) when it cannot: nothing fits (what would
    is `tptrain plan --train`'s), or the flags say otherwise."""
    try:
        line = _train_layout(args)
    except (OSError, ValueError) as exc:
        print(f"tptrain train: error: {exc}", file=sys.stderr)
        return True
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)
    return False


def _train_layout(args: argparse.Namespace) -> str:
    import torch

    from tptrain.diagnostics.train_settings import TrainSettings
    from tptrain.layout import parse_layout
    from tptrain.diagnostics.model_shapes import ModelShapes
    from tptrain.diagnostics.train_plan import layout_problem, plan_training
    from tptrain.models import AutoConfig

    nproc = args.nproc_per_node or torch.cuda.device_count()
    if not nproc:
        raise ValueError("--layout needs the number of ranks: pass --nproc-per-node N (no GPU is visible)")
    if args.layout == "auto" and "RANK" in os.environ and not torch.cuda.is_available():
        raise ValueError("--layout auto under torchrun needs GPUs (each process would measure the cpu profile on its "
                         "own, and could choose differently); give the sizes: --layout tp=2,... or --tp-size ...")
    world = nproc * args.nnodes
    args.nproc_per_node = nproc
    dtype = getattr(torch, args.dtype)
    reference = _reference(args)  # tptrain dpo: its reference, two rows a pair
    settings = TrainSettings(batch_size=(2 if reference else 1) * args.batch_size, seq_len=args.seq_len, dtype=dtype,
                             bf16=args.bf16, gradient_checkpointing=args.gradient_checkpointing,
                             lora_r=getattr(args, "lora_r", 0), optim_in_backward=args.optim_in_backward,
                             pp_schedule=args.pp_schedule, pp_microbatches=args.pp_microbatches,
                             sequence_parallel=args.sequence_parallel, expert_parallel=args.expert_parallel,
                             reference=reference)
    shapes = ModelShapes.of(AutoConfig.from_pretrained(args.model), dtype=dtype)
    note = ""
    if args.layout != "auto":
        chosen = parse_layout(args.layout, world)
        problem = layout_problem(shapes, chosen, settings)
        if problem:
            raise ValueError(f"--layout {chosen.spell()}: {problem}")
    else:
        profile = _profile(argparse.Namespace(device=None, gpu_memory=None))
        plan = plan_training(shapes, world=world, settings=settings, profile=profile)
        usable = [p for p in plan.layouts if p.fits and p.layout.dp_replicate == 1]  # tptrain train: no dp_replicate
        if not usable:
            raise ValueError(f"--layout auto: no layout of {world} ranks fits {profile.name}'s memory at --batch-size "
                             f"{args.batch_size} --seq-len {args.seq_len}; `tptrain plan {args.model} --train --world "
                             f"{world} ...` says what would")
        best = usable[0]
        chosen = best.layout
        note = (f" (the fastest that fits {profile.name}: peak {best.peak / 2**30:.1f} of {best.budget / 2**30:.1f} "
                f"GiB per rank, about {best.time.seconds:.3g} s per step)")
    if chosen.dp_replicate > 1:
        raise ValueError(f"--layout {chosen.spell()}: tptrain train has no dp_replicate; use dp_shard")
    args.tp_size, args.cp_size, args.pp_size = chosen.tp, chosen.cp, chosen.pp
    args.ep_size = chosen.ep if chosen.ep > 1 else None
    return f"tptrain train: --layout {args.layout}: {chosen.spell()} on {world} ranks{note}"


def _reference(args: argparse.Namespace) -> str | None:
    """The reference a `tptrain dpo` run holds (None: `tptrain train`)."""
    if getattr(args, "workflow", "train") != "dpo":
        return None
    reference_free = args.reference_free or set(args.loss_type) <= {"simpo", "orpo"}
    if args.precompute_ref_log_probs or reference_free:
        return "precomputed"
    return "adapters" if args.lora_r else "copy"
