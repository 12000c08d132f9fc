"""tptrain on a CUDA machine in under 10 minutes: one table that says whether the collectives, training, the fused
loss and the backward overlap work on NCCL / CUDA streams, and how fast.

    bash benchmarks/gpu_check.sh                      # a CUDA machine, 1 to 8 GPUs (more: the first 8)
    bash benchmarks/gpu_check.sh --peak-tflops 756    # MFU on a GPU missing from PEAK_TFLOPS (here an H100 PCIe)
    bash benchmarks/gpu_check.sh --dry-run            # the same code at tiny sizes on 2 CPU ranks (gloo, fp32)

The shell script counts the GPUs and launches each part with `python -m torch.distributed.run --standalone`
(`gpu_check.py PART ...`); every part's rank 0 appends rows to one file and `gpu_check.py report` prints them as
one table, then a FAILED line per failed check (which part and case, the max abs error and the tolerance) or per
part that crashed or ran past its limit. Every part runs whatever failed before it; the exit status is 1 if
anything failed.

Parts:
  comm    (every GPU, up to 8 ranks) every collective of tptrain.distributed.comm on NCCL (the default group) against
          the same call on a gloo group over the same ranks (`comm.side_group()`, CPU tensors), same inputs, fp32 and
          bf16: the autograd ones (outputs and input gradients), all-to-all / dispatch_to_ranks with uneven splits
          (zeros included), exchange_counts, the blocking and the async start_* ones (compute queued on the current
          stream between start and wait), any_rank on both groups, raise_on_any_rank, all_gather_object, barrier.
  train   a Qwen3-0.6B-shaped model (random init, saved once with transformers' save_pretrained; tptrain's init
          without transformers) trained for a few AdamW steps in bf16 on the same batches: tp 1 eager, tp 1 with
          each decoder layer torch.compile'd, transformers' own model on the same GPU (plain AdamW loop), and tp 2, 4,
          8 where there are that many GPUs. Step time (median over ranks' slowest), tokens/s, MFU (6 x params x
          tokens / step time / (peak bf16 FLOP/s x GPUs); attention FLOPs not counted), peak
          torch.cuda.max_memory_allocated (max over ranks), and the step-0 loss of every row against tptrain tp 1
          (a sanity check only: at random init every sane model's loss sits near log(vocab)).
  fused   at tp 2 (tp 1 on one GPU, where the overlap's collective is trivial: it needs 2 GPUs to mean anything): the
          fused head + loss (`head_loss_function`, the default in training) against the whole logits
          (`return_logits=True`), and the backward overlap (parallel/colwise_block.py) against TPTRAIN_OVERLAP=0's
          unfused path: loss and every gradient (bf16 tolerance, relative to each tensor's largest value), and the
          forward + backward time and peak memory of each.

Expected runtime on one H200: about 3-4 minutes, an estimate (not yet run on a GPU; put the measured figure here):
half a minute to write the checkpoint, one to two for inductor compiling a layer, seconds for the rest. Each part
has a hard limit (gpu_check.sh: prepare 120 s, comm 90, fused 120, train tp 1 240, tp 2/4/8 75 each, all parts
within 540 s) and a part past its limit is stopped and reported, so the whole ends within 10 minutes whatever the
GPU count. --dry-run: about 60 s of CPU time in 5 launches (so ~40 s on 2 idle cores; 2:45 measured on 2 cores
at load 12); tests/test_gpu_check.py runs it so that this script cannot rot.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

QWEN3_06B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False,
                 tie_word_embeddings=True, initializer_range=0.02)
TINY = dict(QWEN3_06B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# (GPU name contains, bf16 dense TFLOP/s), first match wins: SXM parts unless named.
PEAK_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("A100", 312.0))
# Relative tolerance of a check (max abs error / the reference's largest magnitude), by the dtype it runs in.
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
PARTS = ("prepare", "comm", "train", "fused", "report")  # the table's order
GIB = 2 ** 30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=PARTS)
    p.add_argument("--out", required=True, help="the run's directory: checkpoint, rows (gpu_check.sh makes it)")
    p.add_argument("--dry-run", action="store_true", help="tiny model, fp32, CPU/gloo, no compile")
    p.add_argument("--peak-tflops", type=float, help="the GPU's peak bf16 dense TFLOP/s (default: PEAK_TFLOPS)")
    p.add_argument("--batch", type=int, help="sequences per step (default 4; dry run 2)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default 2048; dry run 32)")
    p.add_argument("--steps", type=int, help="timed steps per row (default 5; dry run 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them (compiled rows: one more)")
    args = p.parse_args(argv)
    small = args.dry_run
    args.batch = args.batch or (2 if small else 4)
    args.seq = args.seq or (32 if small else 2048)
    args.steps = args.steps or (2 if small else 5)
    args.config = TINY if small else QWEN3_06B
    args.dtype = torch.float32 if small else torch.bfloat16
    return args


@dataclass
class Run:
    """One part's view of the job: its options, this rank and device, the checkpoint, where rows go."""

    args: argparse.Namespace
    rank: int
    world: int
    device: torch.device  # cuda:LOCAL_RANK, or the CPU in a dry run
    meta: dict  # what `prepare` recorded: n_params, gpu, ckpt

    @property
    def dtype(self) -> torch.dtype:
        return self.args.dtype

    def tol(self, dtype: torch.dtype | None = None) -> float:
        """The relative tolerance of a check run in `dtype` (default: the model's)."""
        return TOL[dtype or self.dtype]

    @property
    def tokens(self) -> int:
        return self.args.batch * self.args.seq

    def emit(self, part: str, case: str, **fields) -> None:
        """Append one row of the table (rank 0 only; every rank calls it)."""
        if self.rank == 0:
            with open(Path(self.args.out, "rows.jsonl"), "a") as f:
                f.write(json.dumps(dict(part=part, case=case, ranks=self.world, **fields)) + "\n")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    def batch(self, step: int):
        """(ids, labels) of `step`, the same on every rank and for every implementation."""
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, self.args.config["vocab_size"], (self.args.batch, self.args.seq), generator=g)
        return ids.to(self.device), ids.clone().to(self.device)


def prepare(args: argparse.Namespace) -> None:
    """Write the random-init checkpoint (bf16; fp32 in a dry run) and meta.json: parameter count, GPU, peak."""
    out = Path(args.out)
    kw = {k: v for k, v in args.config.items() if k != "model_type"}
    device = "cuda" if torch.cuda.is_available() else "cpu"  # 0.6B initialises in seconds on a GPU
    torch.manual_seed(0)
    with torch.device(device):
        try:
            import transformers
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw))
        except ImportError:  # no peer installed: tptrain's identical random init
            from tptrain.models import AutoConfig, AutoModelForCausalLM
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **kw), device=device)
    model.to(args.dtype).save_pretrained(out / "model")
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (dry run)"
    peak = next((t for name, t in PEAK_TFLOPS if name in gpu), None)
    meta = dict(n_params=sum(p.numel() for p in model.parameters()), gpu=gpu, peak_tflops=peak,
                gpus=torch.cuda.device_count(), ckpt=str(out / "model"))
    (out / "meta.json").write_text(json.dumps(meta))


def start(args: argparse.Namespace) -> Run:
    """Join the job (NCCL and cuda:LOCAL_RANK when CUDA is visible, gloo on CPU) and read what prepare wrote."""
    from tptrain.distributed import init_distributed
    device = init_distributed()
    meta = json.loads(Path(args.out, "meta.json").read_text())
    return Run(args, dist.get_rank(), dist.get_world_size(), device, meta)


# ----------------------------------------------------------------------------- the table

HEADER = ("| part | case | ranks | check | max abs err | step ms | tokens/s | MFU | peak GiB/rank (max) | "
          "loss step 0 |")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _row(r: dict) -> str:
    cells = [r["part"], r["case"], r["ranks"], r.get("check", "-"), _fmt(r.get("err"), ".3g"),
             _fmt(r.get("step_s") and 1e3 * r["step_s"], ".1f"), _fmt(r.get("tok_s"), ",.0f"),
             _fmt(r.get("mfu") and 100 * r["mfu"], ".1f"), _fmt(r.get("peak") and r["peak"] / GIB, ".2f"),
             _fmt(r.get("loss0"), ".4f")]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _check_losses(rows: list[dict]) -> None:
    """Each training row's step-0 loss against tptrain tp 1's (same checkpoint, same batch)."""
    ref = next((r["loss0"] for r in rows if r["part"] == "train" and r["case"] == "tptrain" and r["ranks"] == 1
                and r.get("loss0") is not None), None)
    for r in rows:
        if r["part"] != "train" or r.get("loss0") is None or ref is None or r.get("check", "-") != "-":
            continue
        r["err"] = abs(r["loss0"] - ref)
        ok = r["err"] <= r["tol"] * abs(ref)
        r["check"] = "ok" if ok else "FAIL"
        if not ok:
            r["note"] = f"step-0 loss {r['loss0']:.7f}, tptrain tp 1's {ref:.7f}"


def _failure(r: dict) -> str:
    tol = "" if r.get("tol") is None else f" (relative tolerance {r['tol']:g})"
    note = f": {r['note']}" if r.get("note") else ""
    err = _fmt(r.get("err"), ".3g")
    return f"FAILED {r['part']} / {r['case']} on {r['ranks']} rank(s): max abs err {err}{tol}{note}"


def report(args: argparse.Namespace) -> int:
    """Print the table and every failure; 1 if anything failed."""
    out = Path(args.out)
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()] \
        if (out / "rows.jsonl").exists() else []
    rows.sort(key=lambda r: PARTS.index(r["part"]))  # the table in the docstring's order, whatever ran first
    _check_losses(rows)
    meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else {}
    peak = args.peak_tflops or meta.get("peak_tflops")
    for r in rows:  # 6 N tokens / step time / (peak FLOP/s of the row's GPUs)
        if peak and r.get("step_s"):
            r["mfu"] = 6 * meta["n_params"] * args.batch * args.seq / r["step_s"] / (peak * 1e12 * r["ranks"])
    c = args.config
    where = f"{meta['gpus']} x {meta['gpu']}" if meta.get("gpus") else meta.get("gpu", "?")
    print(f"\ngpu_check: {where}, {str(args.dtype).removeprefix('torch.')}, "
          f"{c['num_hidden_layers']}-layer Qwen3 shape ({meta.get('n_params', 0) / 1e6:.1f}M params), batch "
          f"{args.batch} x {args.seq} tokens, {args.steps} timed steps; MFU = 6 x params x tokens / step / peak "
          f"({peak or '? (pass --peak-tflops)'} TFLOP/s per GPU)\n")
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")
    for r in rows:
        print(_row(r))
    failures = [_failure(r) for r in rows if r.get("check", "").startswith("FAIL")]
    status = out / "status"
    failures += [f"FAILED part {line}" for line in status.read_text().splitlines()] if status.exists() else []
    print("\n".join(["", *failures]) if failures else "\nall checks passed")
    return 1 if failures else 0


def main() -> None:
    args = parse_args()
    if args.part == "report":
        sys.exit(report(args))
    if args.part == "prepare":
        return prepare(args)
    run = start(args)  # the part modules sit next to this script, on sys.path[0]
    if args.part == "comm":
        from gpu_check_comm import comm_part
        comm_part(run)
    elif args.part == "train":
        from gpu_check_train import train_part
        train_part(run)
    else:
        from gpu_check_train import fused_part
        fused_part(run)


if __name__ == "__main__":
    main()
