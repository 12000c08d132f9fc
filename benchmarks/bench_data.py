"""Data at scale: tokenization throughput, time to the first step and the largest process's memory, with the
token cache (training/token_cache.py) cold (a miss: local rank 0 tokenizes) and warm (a hit: every rank maps).

For each corpus size it writes a corpus (the bundled Shakespeare, each copy's documents numbered so no two
copies are the same bytes), then
  * tokenizes it into a fresh cache in this process (MB/s), and, if `datasets` is installed, with
    `datasets.Dataset.map` and the same tokenizer (batched, one process) for comparison;
  * runs `tptrain train --data CORPUS --max-steps 2` twice per layout (tp 2: --tp-size 2 on 2 ranks;
    dp 2: --tp-size 1 --nproc-per-node 2) against one fresh cache: the first run tokenizes, the second maps.
Time to the first step: from the command's start to step 1 in metrics.jsonl. Memory: the largest resident set of
any process of the command's tree (psutil, sampled every 0.1 s). Prints one table, then the headline: each
corpus's first-run overhead (its first run's time to step 1 minus the bundled corpus's, same layout) next to the
machine's limit, the corpus's size over what `encode_batch` alone encodes per second on every core (the
tokenizer's own batch encoding of 64K-character pieces, the first 32 MB of the corpus, in this process), and the
target: the overhead at that limit.

    python benchmarks/bench_data.py                       # the bundled corpus, 164MB and 1GB (minutes; the 1 GB corpus needs ~8 GB disk)
    python benchmarks/bench_data.py --sizes bundled,164MB # the issue's figure: the 164 MB corpus's first-run overhead
    python benchmarks/bench_data.py --sizes bundled,5MB --layouts tp2   # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path

BUNDLED_MODEL = Path(str(files("tptrain") / "data" / "tiny-qwen3"))
BUNDLED_CORPUS = Path(str(files("tptrain") / "data" / "corpus.txt"))
LAYOUTS = {"tp2": ["--tp-size", "2", "--nproc-per-node", "2"], "dp2": ["--tp-size", "1", "--nproc-per-node", "2"]}
UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_size(text: str) -> int:
    for unit, scale in UNITS.items():
        if text.upper().endswith(unit):
            return int(float(text[:-2]) * scale)
    return int(text)


def write_corpus(path: Path, size: int) -> None:
    """About `size` bytes of the bundled corpus's documents, two blank lines apart, each copy numbered."""
    from tptrain.training.data import read_documents

    documents = read_documents(BUNDLED_CORPUS)[1]
    written, copy = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            for doc in documents:
                text = f"[{copy}] {doc}\n\n\n"[:size - written]  # the last document cut to the size asked for
                f.write(text)
                written += len(text.encode("utf-8"))
                if written >= size:
                    break
            copy += 1


def tokenize_throughput(corpus: Path, model: Path, compare: bool = True) -> dict[str, float]:
    """MB/s of a cold token cache build in this process, and of datasets.map with the same tokenizer."""
    from tptrain.text import load_tokenizer
    from tptrain.training.sft_data import cache_store

    tokenizer, mb = load_tokenizer(model), corpus.stat().st_size / 1e6
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        cache_store(corpus, tokenizer, model_dir=model, chat_template=None, assistant_only_loss=True,
                    cache_dir=cache, vocab_size=None)
        out = {"cache MB/s": mb / (time.perf_counter() - start)}
    if not compare:
        return out
    try:
        import datasets
    except ImportError:
        return out
    from tptrain.training.token_stream import text_documents

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        ds = datasets.Dataset.from_generator(lambda: ({"text": d} for d in text_documents(corpus, lambda n: None)),
                                             cache_dir=tmp)
        ds.map(lambda batch: {"ids": tokenizer.encode_batch(batch["text"])}, batched=True, remove_columns=["text"],
               cache_file_name=str(Path(tmp) / "tokens.arrow"))
        out["datasets.map MB/s"] = mb / (time.perf_counter() - start)
    return out


def encode_limit(corpus: Path, model: Path, sample: int = 32 << 20) -> float:
    """MB/s of the tokenizer's `encode_batch` alone, on every core, over the corpus's first `sample` bytes cut into
    the pieces the cache encodes (whole documents for a tokenizer without a cutter): nothing read or written."""
    from tptrain.text import load_tokenizer
    from tptrain.training.token_pieces import piece_cutter
    from tptrain.training.token_stream import text_documents

    tokenizer = load_tokenizer(model)
    cut = piece_cutter(tokenizer) or (lambda text, size: [text])
    batches, batch, size, total = [], [], 0, 0
    for doc in text_documents(corpus, lambda n: None):
        pieces = cut(doc, 1 << 16)
        batch += pieces
        size += len(doc)
        if size >= 4 << 20:
            batches.append(batch)
            batch, total, size = [], total + size, 0
        if total >= sample:
            break
    if batch:
        batches.append(batch)
    text_bytes = sum(len(p.encode("utf-8")) for b in batches for p in b)
    start = time.perf_counter()
    for b in batches:
        tokenizer.encode_batch(b)
    return text_bytes / 1e6 / (time.perf_counter() - start)


def train_once(corpus: Path, model: Path, layout: str, cache: Path, output: Path) -> dict[str, float]:
    """One `tptrain train` run: seconds to step 1, seconds in all, the largest process RSS (MB)."""
    import psutil

    cmd = [sys.executable, "-m", "tptrain", "train", "--model", str(model), "--data", str(corpus), "--max-steps",
           "2", "--save-steps", "0", "--max-new-tokens", "1", "--output-dir", str(output), "--overwrite-output-dir",
           "--data-cache", str(cache), *LAYOUTS[layout]]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_step, peak, root = None, 0, psutil.Process(proc.pid)
    metrics = output / "metrics.jsonl"
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max([peak] + [p.memory_info().rss for p in tree])
        except psutil.Error:  # a process ended while being read
            pass
        if first_step is None and metrics.is_file() and metrics.read_text().strip():
            first_step = time.perf_counter() - start
        time.sleep(0.1)
    log = proc.stdout.read()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{log}")
    cached = next((line for line in log.splitlines() if line.startswith("data cache:")), "?")
    return {"first step s": first_step or float("nan"), "total s": time.perf_counter() - start,
            "max RSS MB": peak / 1e6, "cache": cached.split()[2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="bundled,164MB,1GB",
                        help="corpus sizes, comma-separated; 'bundled' is the bundled corpus (default: bundled,164MB,1GB)")
    parser.add_argument("--layouts", default="tp2,dp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--model", type=Path, default=BUNDLED_MODEL, help="checkpoint (default: the bundled tiny one)")
    parser.add_argument("--datasets-up-to", default="200MB",
                        help="run the datasets.map comparison only for corpora up to this size (default: 200MB)")
    parser.add_argument("--throughput-up-to", default="2GB",
                        help="measure the in-process tokenization MB/s only for corpora up to this size (larger "
                             "ones: the first run's time to step 1 is the measure; default: 2GB)")
    parser.add_argument("--workdir", type=Path, default=None, help="where corpora and caches go (default: a temp dir)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_data-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows, limits = [], {}
    for size_text in args.sizes.split(","):
        if size_text == "bundled":  # the reference the targets are stated against
            corpus = BUNDLED_CORPUS
        else:
            corpus = workdir / f"corpus-{size_text}.txt"
            write_corpus(corpus, parse_size(size_text))
        if corpus.stat().st_size <= parse_size(args.throughput_up_to):
            compare = corpus.stat().st_size <= parse_size(args.datasets_up_to)
            speed = tokenize_throughput(corpus, args.model, compare)
            speed["encode_batch MB/s"] = encode_limit(corpus, args.model)
            limits[size_text] = corpus.stat().st_size / 1e6 / speed["encode_batch MB/s"]  # seconds
            print(f"{size_text}: " + ", ".join(f"{k} {v:.2f}" for k, v in speed.items()), flush=True)
        for layout in args.layouts.split(","):
            cache = workdir / f"cache-{size_text}-{layout}"
            for run in ("first", "second"):
                output = workdir / f"run-{size_text}-{layout}-{run}"  # no earlier metrics.jsonl to mistake
                result = train_once(corpus, args.model, layout, cache, output)
                rows.append((size_text, layout, run, result))
                print(f"  {layout} {run} run: {json.dumps(result)}", flush=True)
    print(f"\n{'corpus':>8} {'layout':>6} {'run':>6} {'cache':>5} {'first step s':>12} {'total s':>8} "
          f"{'max RSS MB':>10}")
    for size_text, layout, run, r in rows:
        print(f"{size_text:>8} {layout:>6} {run:>6} {r['cache']:>5} {r['first step s']:>12.1f} {r['total s']:>8.1f} "
              f"{r['max RSS MB']:>10.0f}")
    print(_headline(rows, limits))


def _headline(rows: list, limits: dict[str, float]) -> str:
    """Each corpus's first-run overhead over the bundled corpus's, next to the machine's limit and the target."""
    first = {(size, layout): r["first step s"] for size, layout, run, r in rows if run == "first"}
    lines = ["", "| corpus | layout | first-run overhead over the bundled corpus s | machine's limit s (size / "
                 "encode_batch MB/s) | overhead / limit | target |", "|---|---|---|---|---|---|"]
    for (size, layout), seconds in first.items():
        if size == "bundled" or ("bundled", layout) not in first:
            continue
        overhead, limit = seconds - first[("bundled", layout)], limits.get(size)
        ratio = f"{overhead / limit:.2f}x" if limit else "-"
        lines.append(f"| {size} | {layout} | {overhead:.1f} | {f'{limit:.1f}' if limit else '-'} | {ratio} | "
                     "overhead at the limit (1.0x) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
