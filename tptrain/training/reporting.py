"""What the user sees while training: a rank-0 progress bar, a metrics JSONL, a loss-curve PNG, and a tracker.

    reporter = Reporter("runs/x", total_steps=300, enabled=rank == 0, report_to="wandb", config={...})
    reporter.log(step, {"loss": 3.2, "learning_rate": 1e-3, "num_tokens": 8192})
    reporter.close()   # writes runs/x/loss.png

Every other rank passes enabled=False and stays silent, so the console shows one bar, not one per rank.
Trackers (report_to): "tensorboard" (a SummaryWriter on output_dir/runs) or "wandb" (a Weights & Biases run:
the active one if the caller started one, as `tptrain train` does with `wandb_run`, else a new one); each gets
every numeric metric, as train/<name> or eval/<name>. Their packages are imported only when asked for.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator


class Reporter:
    """Progress bar + `metrics.jsonl` + `loss.png` in `output_dir`; a no-op when not `enabled`.

    `log(step, metrics)` takes the step just finished (1-based) and its metrics: `loss` and
    `learning_rate` are shown on the bar, `num_tokens` (tokens one step trains on, all ranks
    together) gives tokens/s since the previous log; every key is written to the JSONL line as given.
    """

    def __init__(self, output_dir: str | Path, *, total_steps: int, enabled: bool, report_to: str | None = None,
                 config: dict[str, Any] | None = None) -> None:
        """report_to: None / "none", "tensorboard" or "wandb"; config: the W&B run's config when this starts it."""
        self.enabled = enabled
        self._tracker = None  # rank 0 only
        if enabled and report_to == "tensorboard":
            self._tracker = _TensorBoard(output_dir)
        elif enabled and report_to == "wandb":
            self._tracker = _WandB(output_dir, config or {})
        self.path = Path(output_dir) / "metrics.jsonl"
        self.plot_path = Path(output_dir) / "loss.png"
        self.total_steps = total_steps
        self._bar = None
        self._last_time, self._last_step = 0.0, 0

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._bar is None:
            self._start(step, now)
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        elapsed, steps = now - self._last_time, step - self._last_step  # several steps when logging_steps > 1
        self._last_time, self._last_step = now, step
        if "num_tokens" in metrics and elapsed > 0:
            record["tokens_per_second"] = round(record["num_tokens"] * steps / elapsed, 1)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self._tracker is not None:
            self._tracker.log({key.replace("eval_", "eval/") if key.startswith("eval_") else f"train/{key}": value
                               for key, value in record.items() if key != "step" and isinstance(value, (int, float))},
                              step)
        shown = {"loss": record.get("loss"), "lr": record.get("learning_rate"),
                 "acc": record.get("rewards/accuracies"), "margin": record.get("rewards/margins"),  # preference runs
                 "tok/s": record.get("tokens_per_second")}
        self._bar.set_postfix({k: _short(v) for k, v in shown.items() if v is not None}, refresh=False)
        self._bar.update(step - self._bar.n)

    def message(self, text: str) -> None:
        """A line above the bar (rank 0 only), e.g. "saved checkpoint-200"."""
        if self.enabled:
            from tqdm.auto import tqdm

            tqdm.write(text)

    def amend(self, fields: dict[str, Any]) -> None:
        """Add `fields` to the last record of metrics.jsonl (the run's last step: e.g. its peak memory, measured
        after the final save), or write them as a record of their own (step 0) when there is none."""
        if not self.enabled:
            return
        records = read_metrics(self.path)
        if records:
            records[-1].update({k: _plain(v) for k, v in fields.items()})
        else:
            records = [{"step": 0, **fields}]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")

    def close(self) -> None:
        """Finish the bar and plot every logged loss (earlier, resumed runs included) to loss.png."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tracker is not None:
            self._tracker.close()
        records = read_metrics(self.path)
        if records:
            plot_loss(records, self.plot_path)

    def _start(self, step: int, now: float) -> None:
        """First log of this run: drop lines of steps being redone (a resume), open the bar at `step - 1`."""
        from tqdm.auto import tqdm

        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r["step"] < step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        # Redrawn twice a second on a terminal; in a log file (no tty) one line every 30 s is plenty.
        self._bar = tqdm(total=self.total_steps, initial=step - 1, desc="train", unit="step", dynamic_ncols=True,
                         mininterval=0.5 if sys.stderr.isatty() else 30)
        self._last_time = now  # the first step has no previous one to time against: no tokens/s for it


class _TensorBoard:
    def __init__(self, output_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(Path(output_dir) / "runs"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class _WandB:
    """Logs to the active W&B run (the caller's: it finishes it) or to one started here (finished at close)."""

    def __init__(self, output_dir: str | Path, config: dict[str, Any]) -> None:
        wandb = _import_wandb()
        self._started = wandb.run is None
        self.run = _init_wandb(output_dir, config) if self._started else wandb.run

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        if self._started:
            self.run.finish()


@contextlib.contextmanager
def wandb_run(output_dir: str | Path, config: dict[str, Any], *, enabled: bool) -> Iterator[Any]:
    """While active (when `enabled`: rank 0 of a --report-to wandb run): a W&B run with `config` as its config,
    which a Reporter inside logs to; finished on exit, with exit code 1 after an exception. Yields the run (or
    None when not enabled)."""
    if not enabled:
        yield None
        return
    run = _init_wandb(output_dir, config)
    failed = True
    try:
        yield run
        failed = False
    finally:
        run.finish(exit_code=int(failed))


def _init_wandb(output_dir: str | Path, config: dict[str, Any]) -> Any:
    """A new W&B run: project $WANDB_PROJECT (default "tptrain"), its local files under output_dir/wandb unless
    $WANDB_DIR says where ($WANDB_MODE=offline: only there, no network)."""
    wandb = _import_wandb()
    directory = os.environ.get("WANDB_DIR") or str(output_dir)
    Path(directory).mkdir(parents=True, exist_ok=True)
    return wandb.init(project=os.environ.get("WANDB_PROJECT", "tptrain"), dir=directory, config=_json_safe(config))


def _import_wandb():
    try:
        import wandb
    except ImportError:
        raise ImportError("report_to='wandb' (--report-to wandb) needs the wandb package, which is not installed: "
                          "pip install wandb (or pip install \"tptrain[wandb]\")") from None
    return wandb


def _json_safe(config: dict[str, Any]) -> dict[str, Any]:
    """Paths, dtypes and other objects as their strings (W&B keeps a config as JSON)."""
    return json.loads(json.dumps(config, default=str))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


FINAL_WINDOW = 10  # steps averaged into the one final-loss figure: console summary, loss.png title and curve


def logged_losses(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, loss) of every metrics record that has a numeric loss."""
    return [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]


def loss_headline(losses: list[float]) -> str:
    """"loss 8.383 -> 5.307 (mean of the last 10 steps)": what the console and loss.png's title both say."""
    tail = losses[-FINAL_WINDOW:]
    return f"loss {losses[0]:.3f} -> {sum(tail) / len(tail):.3f} (mean of the last {len(tail)} steps)"


def plot_loss(records: list[dict[str, Any]], path: str | Path) -> None:
    """Loss per step and its moving average over FINAL_WINDOW steps, whose last point is the headline's
    final figure; the title (also the PNG's Title text) is `loss_headline`. No pyplot: no global backend."""
    from matplotlib.figure import Figure

    points = logged_losses(records)
    if not points:
        return
    steps, losses = zip(*points)
    smooth = [sum(losses[max(0, i - FINAL_WINDOW + 1):i + 1]) / (i + 1 - max(0, i - FINAL_WINDOW + 1))
              for i in range(len(losses))]
    title = f"{loss_headline(list(losses))}, step {steps[-1]}"
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    ax.plot(steps, losses, alpha=0.35, label="loss")
    ax.plot(steps, smooth, label=f"mean of the last {FINAL_WINDOW} steps")
    evals = [(r["step"], r["eval_loss"]) for r in records if isinstance(r.get("eval_loss"), (int, float))]
    if evals:  # the evaluation loss (whole eval set) next to the training loss
        ax.plot(*zip(*evals), marker="o", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, metadata={"Title": title})


def _plain(value: Any) -> Any:
    """Tensors and numpy scalars to plain Python numbers, so the line is JSON."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.4f}" if abs(value) >= 1e-2 else f"{value:.2e}"
    return str(value)
