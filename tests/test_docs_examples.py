"""Every example in README.md and docs/*.md runs: each ```python and ```bash/```sh/```shell block is one test
case, with the id FILE:LINE of its opening fence. Blocks that cannot run on one machine (output listings,
multi-node commands, benchmarks of many minutes) are fenced ```text, so these fences are exactly the runnable
examples.

Each example runs in its own tmp_path (nothing is written into the repo), against the checkout this file is in
(PYTHONPATH = its root), offline (HF_HUB_OFFLINE=1, an empty HF_HOME), with these substitutions:

- Hub ids become local checkpoints, built once per session from the bundled model (tptrain/data/tiny-qwen3,
  4.2M parameters): "Qwen/Qwen3-0.6B" and "Qwen/Qwen3-8B" -> the bundled config with random weights (seed 0)
  and its tokenizer; "Qwen/Qwen3-30B-A3B" -> the same shape as a qwen3_moe (4 experts, top-2);
  "bigcode/starcoder2-3b" -> a tiny starcoder2 written by transformers (skipped without transformers).
  "tptrain/data/..." becomes this checkout's absolute path.
- Files the examples name are in the temp dir: corpus.txt (the first 60 kB of the bundled corpus), my.jsonl
  ({"text"} lines of the same), chat.jsonl and eval.jsonl (chats), my-instruct-model/ (the bundled model with
  a ChatML tokenizer and Qwen3's chat template).
- Fewer steps, smaller batches: every step count (--max-steps, --save-steps, --eval-steps, --warmup-steps and
  the TrainingArguments keywords max_steps, save_steps, eval_steps, warmup_steps) N becomes ceil(N / 500)
  (1000 -> 2; a run to 500 resumed to 1000 stays a resume: 1 -> 2); --batch-size and
  per_device_train_batch_size are capped at 2, --seq-len and seq_len at 64. A `tptrain train` without
  --max-steps (or --num-epochs), --batch-size or --seq-len gets --max-steps 2, --batch-size 2, --seq-len 64.
- Shell blocks run under `bash -euo pipefail` with these commands defined: `tptrain ...` -> `python -m tptrain
  ...` (train arguments reduced as above); `./run.sh ...` -> `tptrain train ...` (what run.sh execs);
  `torchrun ...` -> `python -m torch.distributed.run --standalone ...` (a free port); `python` -> this
  interpreter; `./test.sh ...` -> `python -m pytest --collect-only -q ... tests/test_docs_examples.py` in the
  repo (running the suite from inside itself would take half an hour; collecting this file checks the options
  and marker expressions in seconds); `ruff ...` -> ruff in the repo root, without a cache (the case is skipped
  when ruff is not installed). `.venv/bin/` prefixes are dropped.
- Python blocks whose first line is `# torchrun --nproc-per-node N NAME.py` run as NAME.py under
  `python -m torch.distributed.run --standalone --nproc-per-node N` (N <= 2); others as one `python` process.

Cases that start several processes (torchrun, `tptrain train`, `./run.sh`) are marked `distributed`.
Run as a script, this file is the shim the shell commands above go through (`python THIS_FILE tptrain ...`).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"python": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
NOT_RUN = {"text", "console", "json", "jsonl", "yaml", "toml", "jinja", "diff"}
README_MAX_LINES = 250
STEP_DIVISOR, MAX_BATCH, MAX_SEQ_LEN, DEFAULT_STEPS = 500, 2, 64, 2
MAX_RANKS = 2
TIMEOUT_S = 300
HUB_IDS = {"Qwen/Qwen3-0.6B": "dense", "Qwen/Qwen3-8B": "dense", "Qwen/Qwen3-30B-A3B": "moe",
           "bigcode/starcoder2-3b": "starcoder2"}
TORCHRUN_LINE = re.compile(r"#\s*torchrun\s+--nproc-per-node\s+(\d+)\s+(\w+\.py)")


# ------------------------------------------------------------------ finding the examples


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file (``` or ~~~ fences, indented ones dedented)."""
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        start, body, i = i + 1, [], i + 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"{path.relative_to(ROOT)}:{start}: the fence opened here is never closed")
        blocks.append(Block(path, start, lang, "\n".join(body) + "\n"))
        i += 1
    return blocks


def _spawns_processes(block: Block) -> bool:
    if RUNNABLE[block.lang] == "python":
        return bool(TORCHRUN_LINE.match(block.code.lstrip()))
    return bool(re.search(r"tptrain train|\./run\.sh|torchrun", block.code))


def _cases() -> list:
    cases = []
    for path in DOCS:
        for block in fenced_blocks(path):
            if block.lang in RUNNABLE:
                marks = [pytest.mark.distributed] if _spawns_processes(block) else []
                cases.append(pytest.param(block, id=block.id, marks=marks))
    return cases


CASES = _cases()


# ------------------------------------------------------------------ reductions (also used by the shim below)


def _fewer_steps(n: int) -> int:
    return max(1, math.ceil(n / STEP_DIVISOR))


STEP_FLAGS = ("--max-steps", "--save-steps", "--eval-steps", "--warmup-steps")
CAPS = {"--batch-size": MAX_BATCH, "--seq-len": MAX_SEQ_LEN}


def reduce_train_args(args: list[str]) -> list[str]:
    """`tptrain train` arguments with fewer steps and smaller batches (see the module docstring)."""
    out, i, seen = [], 0, set()
    while i < len(args):
        arg = args[i]
        flag, eq, value = arg.partition("=")
        if flag in STEP_FLAGS or flag in CAPS:
            seen.add(flag)
            if not eq:
                i += 1
                value = args[i]
            n = int(value)
            n = _fewer_steps(n) if flag in STEP_FLAGS else min(n, CAPS[flag])
            out += [flag, str(n)]
        else:
            if arg == "--num-epochs":
                seen.add("--max-steps")
            out.append(arg)
        i += 1
    if "-h" in args or "--help" in args:
        return out
    for flag, default in (("--max-steps", DEFAULT_STEPS), ("--batch-size", MAX_BATCH), ("--seq-len", MAX_SEQ_LEN)):
        if flag not in seen:
            out += [flag, str(default)]
    return out


def reduce_python(code: str) -> str:
    code = re.sub(r"\b(max_steps|save_steps|eval_steps|warmup_steps)(\s*=\s*)(\d+)",
                  lambda m: f"{m.group(1)}{m.group(2)}{_fewer_steps(int(m.group(3)))}", code)
    code = re.sub(r"\b(per_device_train_batch_size)(\s*=\s*)(\d+)",
                  lambda m: f"{m.group(1)}{m.group(2)}{min(int(m.group(3)), MAX_BATCH)}", code)
    return re.sub(r"\b(seq_len)(\s*=\s*)(\d+)",
                  lambda m: f"{m.group(1)}{m.group(2)}{min(int(m.group(3)), MAX_SEQ_LEN)}", code)


def shim(argv: list[str]) -> None:
    """`python THIS_FILE COMMAND ARGS`: run COMMAND as the docs examples mean it, in this interpreter."""
    command, args, py = argv[0], argv[1:], sys.executable
    if command == "tptrain":
        if args[:1] == ["train"]:
            args = ["train", *reduce_train_args(args[1:])]
        os.execv(py, [py, "-m", "tptrain", *args])
    if command == "torchrun":
        if "-m" in args and args[args.index("-m") + 1: args.index("-m") + 3] == ["tptrain", "train"]:
            at = args.index("-m") + 3
            args = [*args[:at], *reduce_train_args(args[at:])]
        standalone = [] if any(a.startswith(("--rdzv", "--nnodes", "--master")) for a in args) else ["--standalone"]
        os.execv(py, [py, "-m", "torch.distributed.run", *standalone, *args])
    if command == "test.sh":  # collect this file only: checks the options and marker expressions in seconds
        os.chdir(ROOT)
        os.execv(py, [py, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args,
                      str(Path(__file__).resolve().relative_to(ROOT))])
    raise SystemExit(f"docs shim: unknown command {command!r}")


SHELL_PREAMBLE = """\
set -euo pipefail
tptrain() { "$PY" "$DOCS_SHIM" tptrain "$@"; }
torchrun() { "$PY" "$DOCS_SHIM" torchrun "$@"; }
__run_sh() { "$PY" "$DOCS_SHIM" tptrain train "$@"; }
__test_sh() { "$PY" "$DOCS_SHIM" test.sh "$@"; }
python() { "$PY" "$@"; }
python3() { "$PY" "$@"; }
ruff() { (cd "$DOCS_ROOT" && RUFF_NO_CACHE=true RUFF_COMMAND "$@"); }
"""


# ------------------------------------------------------------------ what the examples name


class HubCheckpoints:
    """Local stand-ins for the hub ids, built on first use (one session-wide directory)."""

    def __init__(self, root: Path) -> None:
        self.root, self.built = root, {}

    def bundled(self) -> Path:
        return ROOT / "tptrain" / "data" / "tiny-qwen3"

    def get(self, kind: str) -> Path:
        if kind not in self.built:
            self.built[kind] = getattr(self, f"_{kind}")(self.root / kind)
        return self.built[kind]

    def _save(self, config_dict: dict, directory: Path, tokenizer_from: Path) -> Path:
        import torch

        from tptrain import AutoConfig, AutoModelForCausalLM

        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps(config_dict))
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32) \
            .save_pretrained(directory)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / name, directory / name)
        return directory

    def _dense(self, directory: Path) -> Path:
        return self._save(json.loads((self.bundled() / "config.json").read_text()), directory, self.bundled())

    def _moe(self, directory: Path) -> Path:
        config = json.loads((self.bundled() / "config.json").read_text())
        config.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=1, norm_topk_prob=True,
                      mlp_only_layers=[], output_router_logits=False, router_aux_loss_coef=0.001)
        return self._save(config, directory, self.bundled())

    def _starcoder2(self, directory: Path) -> Path:
        if importlib.util.find_spec("transformers") is None:
            pytest.skip("the transformers backend example needs transformers (pip install 'tptrain[hf]')")
        import torch
        import transformers

        config = transformers.Starcoder2Config(vocab_size=4096, hidden_size=128, intermediate_size=256,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=1024, bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        transformers.Starcoder2ForCausalLM(config).save_pretrained(directory)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(self.bundled() / name, directory / name)
        return directory

    def _instruct(self, directory: Path) -> Path:
        from tests.helpers.chat import QWEN3, chat_checkpoint

        chat_checkpoint(directory / "template", QWEN3)
        return self._save(json.loads((directory / "template" / "config.json").read_text()), directory / "model",
                          directory / "template")


def _chats(n: int, offset: int = 0) -> str:
    from tests.helpers.chat import CHATS

    lines = []
    for i in range(offset, offset + n):
        chat = [dict(turn) for turn in CHATS[i % len(CHATS)]]
        chat[-1]["content"] += f" ({i})"
        lines.append(json.dumps({"messages": chat}))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def hub_checkpoints(tmp_path_factory) -> HubCheckpoints:
    return HubCheckpoints(tmp_path_factory.mktemp("docs-checkpoints"))


@pytest.fixture(scope="session")
def data_files(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("docs-data")
    text = (ROOT / "tptrain" / "data" / "corpus.txt").read_text()[:60_000]  # the first ~12k tokens: tokenized fast
    (directory / "corpus.txt").write_text(text)
    documents = [d.strip() for d in re.split(r"\n\s*\n\s*\n", text) if d.strip()]
    (directory / "my.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    (directory / "chat.jsonl").write_text(_chats(24))
    (directory / "eval.jsonl").write_text(_chats(6, offset=24))
    return directory


def _prepare(block: Block, workdir: Path, checkpoints: HubCheckpoints, data_files: Path) -> str:
    """The example's text with hub ids and repo paths substituted; the files it names put in `workdir`."""
    code = block.code
    for hub_id, kind in HUB_IDS.items():
        if hub_id in code:
            code = code.replace(hub_id, str(checkpoints.get(kind)))
    code = re.sub(r"(?<![\w/.])tptrain/data/", str(ROOT / "tptrain" / "data") + "/", code)
    for name in ("corpus.txt", "my.jsonl", "chat.jsonl", "eval.jsonl"):
        (workdir / name).symlink_to(data_files / name)
    if "my-instruct-model" in code:
        (workdir / "my-instruct-model").symlink_to(checkpoints.get("instruct"))
    return code


def _ruff() -> list[str]:
    """How to run ruff here: the interpreter's module, or one on PATH; [] when there is none."""
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    return [shutil.which("ruff")] if shutil.which("ruff") else []


def _environment(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
               PY=sys.executable, DOCS_SHIM=str(Path(__file__).resolve()), DOCS_ROOT=str(ROOT), HF_HUB_OFFLINE="1",
               HF_HOME=str(workdir / ".hf-home"), OMP_NUM_THREADS="1", MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="1")
    return env


# ------------------------------------------------------------------ the tests


@pytest.mark.parametrize("block", CASES)
def test_example_runs(block: Block, tmp_path: Path, hub_checkpoints: HubCheckpoints, data_files: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    code = _prepare(block, workdir, hub_checkpoints, data_files)
    if RUNNABLE[block.lang] == "python":
        first = TORCHRUN_LINE.match(code.lstrip())
        script = workdir / (first.group(2) if first else "example.py")
        script.write_text(reduce_python(code))
        if first:
            ranks = int(first.group(1))
            assert ranks <= MAX_RANKS, f"{block.id}: docs examples run on at most {MAX_RANKS} ranks, not {ranks}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   script.name]
        else:
            cmd = [sys.executable, script.name]
    else:
        if re.search(r"^\s*ruff\b", code, re.MULTILINE) and not _ruff():
            pytest.skip("ruff is not installed in this environment (CI installs it)")
        code = code.replace(".venv/bin/", "").replace("./run.sh", "__run_sh").replace("./test.sh", "__test_sh")
        script = workdir / "example.sh"
        script.write_text(SHELL_PREAMBLE.replace("RUFF_COMMAND", shlex.join(_ruff() or ["false"])) + code)
        cmd = ["bash", script.name]
    try:
        done = subprocess.run(cmd, check=False, cwd=workdir, env=_environment(workdir), capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{block.id} did not finish within {TIMEOUT_S} s:\n{script.read_text()}") from exc
    assert done.returncode == 0, (f"{block.id} exited with {done.returncode}\n--- as run ({script.name}) ---\n"
                                  f"{script.read_text()}\n--- stdout ---\n{done.stdout[-4000:]}\n"
                                  f"--- stderr ---\n{done.stderr[-6000:]}")


def test_examples_are_found_and_every_fence_is_labelled() -> None:
    """A fence without a language, or one this test does not know, would silently escape the run."""
    unknown = [f"{b.id}: ```{b.lang}" for path in DOCS for b in fenced_blocks(path)
               if b.lang not in RUNNABLE and b.lang not in NOT_RUN
               and not (b.lang == "" and path.name == "DESIGN.md")]  # its diagrams; not this test's file to edit
    assert not unknown, ("fence these as python/bash (run) or text (not run):\n" + "\n".join(unknown))
    assert {case.values[0].path.name for case in CASES} >= {"README.md", "models.md", "cli.md", "training.md",
                                                            "fine-tuning.md", "checkpoints.md"}
    assert all(block.id.startswith(("README.md:", "docs/")) for block in (case.values[0] for case in CASES))


def test_reductions() -> None:
    assert reduce_train_args(["--max-steps", "1000", "--save-steps=250", "--batch-size", "4", "--seq-len", "1024"]) \
        == ["--max-steps", "2", "--save-steps", "1", "--batch-size", "2", "--seq-len", "64"]
    assert reduce_train_args([]) == ["--max-steps", "2", "--batch-size", "2", "--seq-len", "64"]
    assert reduce_train_args(["--num-epochs", "2", "--seq-len", "32"]) == \
        ["--num-epochs", "2", "--seq-len", "32", "--batch-size", "2"]
    assert reduce_python("TrainingArguments(max_steps=1000, seq_len=1024, per_device_train_batch_size=8)") \
        == "TrainingArguments(max_steps=2, seq_len=64, per_device_train_batch_size=2)"


def test_readme_is_a_five_minute_read() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
    first_screen = "\n".join(lines[:30])
    assert "./run.sh" in first_screen and "./test.sh" in first_screen, "the two commands belong on the first screen"


def test_checkpoints_doc_warns_that_resumable_checkpoints_are_pickles() -> None:
    text = (ROOT / "docs" / "checkpoints.md").read_text()
    section = re.search(r"^## Security.*?(?=^## )", text, re.DOTALL | re.MULTILINE)
    assert section, "docs/checkpoints.md needs its '## Security' section"
    words = " ".join(section.group(0).split())
    for needed in (".metadata", "*.pth", "pickles", "resuming from an untrusted checkpoint can run",
                   "Hugging Face export is safe", "safetensors"):
        assert needed in words, f"docs/checkpoints.md's security section must say plainly: missing {needed!r}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_relative_links_resolve() -> None:
    broken = []
    for path in DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+\s+(.*)$", linked.read_text(), re.MULTILINE)}
                if anchor not in slugs:
                    broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


if __name__ == "__main__":
    shim(sys.argv[1:])
