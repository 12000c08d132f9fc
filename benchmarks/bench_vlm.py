"""A vision-language model's training step at tp 2: tptrain (AutoModelForImageTextToText: text decoder, vision tower
and projector split) against transformers' own TP (its `tp_plan="auto"`, as `DistributedConfig(tp_plan="auto")`:
the text decoder split, the tower replicated) on the same checkpoint and batches, on CPU. One table.

    .venv-vision/bin/python benchmarks/bench_vlm.py                      # ~5 minutes on an idle 2-core machine
    .venv-vision/bin/python benchmarks/bench_vlm.py --steps 2 --warmup 1 --impls tptrain

The model: a Qwen2.5-VL built with transformers' random init (text decoder 8 layers of 512, vision tower 8 layers of
512 with its patch merger; 66M parameters), saved once under --cache. A batch: 2 rows, each an image of 224 x 224
pixels (256 patches of 14 x 14, merged 2 x 2 into 64 image tokens) and 192 text tokens; labels on the text. Each
implementation runs in fresh processes, two ranks under `python -m torch.distributed.run --standalone
--nproc-per-node 2`, ONE thread per rank (OMP_NUM_THREADS=1, torch.set_num_threads(1)), gloo, fp32: each library's
own AdamW as its Trainer builds it (tptrain's `build_optimizer`, transformers' Trainer's), forward + backward +
optimizer step timed (the median over --steps of the slowest rank, after --warmup). Memory per rank (bench_tp.py's
columns): "max RSS" is the process's lifetime peak resident set (getrusage: imports, the checkpoint's pages, all),
"peak anon" the anonymous RSS over the run minus the value after the imports. The loss of the first step is printed
for both: the same model on the same batch, so they agree to fp32 rounding.

Targets (issue 43): tptrain's step time <= 0.8x the peer's and its max RSS per rank <= 0.8x.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_tp's launcher and memory sampler
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_tp import PeakSampler, _launch, _peer_optimizer  # noqa: E402

IMAGE, START, END = 8000, 8001, 8002  # the image placeholder and the ids around an image
TEXT = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=4096,
            rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[8, 12, 12]))
VISION = dict(depth=8, hidden_size=512, intermediate_size=1536, num_heads=8, out_hidden_size=512, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[3, 7])
BATCH, SIDE, TEXT_TOKENS = 2, 224, 192
PATCHES = (SIDE // 14) ** 2  # 256 per image, 64 image tokens after the 2 x 2 merge
MB = 2**20


def checkpoint(cache: Path) -> Path:
    """The Qwen2.5-VL checkpoint (transformers' random init), written once."""
    import torch
    import transformers

    path = cache / "qwen2_5_vl-66m"
    if (path / "config.json").exists():
        return path
    config = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE,
                                           video_token_id=8003, vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".qwen2_5_vl-"))
    transformers.Qwen2_5_VLForConditionalGeneration(config).save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def batches(n: int) -> list[dict]:
    """`n` batches of BATCH rows: [start, 64 image tokens, end, text], pixel values of one image per row."""
    import torch

    out = []
    for i in range(n):
        gen = torch.Generator().manual_seed(1000 + i)
        image = [START, *[IMAGE] * (PATCHES // 4), END]
        ids = torch.cat([torch.tensor([image] * BATCH), torch.randint(3, IMAGE, (BATCH, TEXT_TOKENS), generator=gen)], 1)
        labels = ids.clone()
        labels[:, :len(image)] = -100
        out.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids),
                    "pixel_values": torch.randn(BATCH * PATCHES, 3 * 2 * 14 * 14, generator=gen),
                    "image_grid_thw": torch.tensor([[1, SIDE // 14, SIDE // 14]] * BATCH)})
    return out


def load(impl: str, ckpt: str):
    import torch

    if impl == "tptrain":
        from tptrain import AutoModelForImageTextToText, DistributedConfig
        return AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32,
                                                           distributed_config=DistributedConfig(tp_size=2))
    import transformers
    return transformers.AutoModelForImageTextToText.from_pretrained(
        ckpt, dtype=torch.float32, distributed_config=transformers.DistributedConfig(tp_size=2, tp_plan="auto"))


def optimizer(impl: str, model):
    """Each library's own AdamW at its Trainer's defaults (lr 1e-4, no weight decay)."""
    if impl != "tptrain":
        return _peer_optimizer(model)
    from tptrain.training.args import TrainingArguments
    from tptrain.training.optim import build_optimizer
    return build_optimizer(model, TrainingArguments(output_dir=tempfile.mkdtemp(), learning_rate=1e-4,
                                                    max_grad_norm=0))


def worker(spec: dict) -> None:
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401 - imported by both: in the baseline
    import tptrain.models.auto  # noqa: F401

    torch.set_num_threads(1)
    sampler = PeakSampler()
    baseline = sampler.reset()
    model = load(spec["impl"], spec["ckpt"]).train()
    opt = optimizer(spec["impl"], model)
    times, losses = [], []
    for batch in batches(spec["warmup"] + spec["steps"]):
        dist.barrier()
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    result = {"times": times[spec["warmup"]:], "loss0": losses[0], "peak": sampler.peak - baseline,
              "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    Path(spec["out"], f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", default="tptrain,peer", help="comma-separated: tptrain,peer")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/tptrain-bench"), help="checkpoint cache dir")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint(cache)
    results = {}
    for impl in args.impls.split(","):
        spec = dict(impl=impl, ckpt=str(ckpt), steps=args.steps, warmup=args.warmup)
        ranks = _launch(spec, 2, args.timeout, script=__file__)
        results[impl] = ranks if isinstance(ranks, str) else {
            "step": statistics.median(max(t) for t in zip(*(r["times"] for r in ranks))),
            "maxrss": [r["maxrss"] for r in ranks], "peak": [r["peak"] for r in ranks], "loss0": ranks[0]["loss0"]}
        print(f"# {impl}: {results[impl]}", file=sys.stderr, flush=True)
    print(table(results, args))


def table(results: dict, args) -> str:
    load = os.getloadavg()[0]
    rows = [f"bench_vlm.py --steps {args.steps} --warmup {args.warmup}: Qwen2.5-VL 66M, tp 2, fp32, gloo, 1 thread per "
            f"rank, {len(os.sched_getaffinity(0))} cores, load average {load:.1f} at the end",
            "", "| impl | step s | max RSS MB rank 0 / 1 | peak anon MB rank 0 / 1 | loss step 0 |", "|---|---|---|---|---|"]
    for impl, r in results.items():
        if isinstance(r, str):
            rows.append(f"| {impl} | {r} | | | |")
            continue
        rows.append(f"| {impl} | {r['step']:.2f} | {' / '.join(f'{m / MB:.0f}' for m in r['maxrss'])} | "
                    f"{' / '.join(f'{m / MB:.0f}' for m in r['peak'])} | {r['loss0']:.4f} |")
    ours, peer = results.get("tptrain"), results.get("peer")
    if isinstance(ours, dict) and isinstance(peer, dict):
        time_ratio, rss_ratio = ours["step"] / peer["step"], max(ours["maxrss"]) / max(peer["maxrss"])
        rows += ["", f"tptrain / peer: step time {time_ratio:.2f}x (target <= 0.8: {'met' if time_ratio <= 0.8 else 'missed'}), "
                 f"max RSS per rank {rss_ratio:.2f}x (target <= 0.8: {'met' if rss_ratio <= 0.8 else 'missed'})"]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
