"""Reward functions (TRL's signature) and the advantages of their rewards, as TRL 1.16's GRPOTrainer computes them.

    funcs = load_reward_funcs(["my_rewards:has_keyword", len_reward])    # "module:function" or callables
    rewards = score(funcs, prompts, completions, columns)               # (completions, funcs), float64
    adv = advantages(weighted(rewards, weights), group=4, scale="group")

A reward function is called `f(prompts=..., completions=..., completion_ids=..., **columns)` with one entry per
completion (each prompt repeated num_generations times, with its dataset row's other columns), and returns one
number per completion (None: not scored by this function, as TRL). Anything else is a ValueError naming the
function.
"""
from __future__ import annotations

import importlib
import math
import numbers
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch


def load_reward_funcs(specs: Sequence[Any]) -> list[Callable]:
    """Each entry: a callable, or "module:function" (module importable, or a .py path: "rewards.py:fn")."""
    if not specs:
        raise ValueError("GRPOTrainer needs at least one reward function (reward_funcs=[f], or --reward-funcs "
                         "module:function)")
    return [spec if callable(spec) else load_reward_func(spec) for spec in specs]


def load_reward_func(spec: Any) -> Callable:
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"reward function {spec!r}: give a callable or 'module:function' (e.g. "
                         "'my_rewards:has_keyword', or 'path/to/rewards.py:has_keyword')")
    module_name, name = spec.split(":")
    try:
        module = _import(module_name)
    except ImportError as exc:
        raise ValueError(f"reward function {spec!r}: cannot import module {module_name!r} ({exc}); put it on "
                         "PYTHONPATH or give the .py file's path") from None
    func = getattr(module, name, None)
    if not callable(func):
        raise ValueError(f"reward function {spec!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) "
                         f"has no function {name!r}")
    return func


def _import(module_name: str):
    path = Path(module_name)
    if path.suffix != ".py":
        return importlib.import_module(module_name)
    if not path.is_file():
        raise ImportError(f"no file {path}")
    spec = importlib.util.spec_from_file_location(f"tptrain_rewards_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def func_name(func: Callable) -> str:
    """TRL's name for a reward function in its metrics: its __name__."""
    return getattr(func, "__name__", type(func).__name__)


def score(funcs: Sequence[Callable], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list]) -> torch.Tensor:
    """(completions, funcs) float64 rewards, NaN where a function returned None."""
    out = torch.empty(len(completions), len(funcs), dtype=torch.float64)
    for j, func in enumerate(funcs):
        name = func_name(func)
        try:
            values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as exc:
            raise ValueError(f"reward function {name!r} raised {type(exc).__name__}: {exc} (called with "
                             f"{len(completions)} completions and the columns {sorted(columns)})") from exc
        out[:, j] = torch.tensor(_checked(name, values, len(completions)), dtype=torch.float64)
    return out


def _checked(name: str, values: Any, count: int) -> list[float]:
    try:
        values = list(values)
    except TypeError:
        raise ValueError(f"reward function {name!r} returned {type(values).__name__}, not a list of numbers (one per "
                         "completion)") from None
    if len(values) != count:
        raise ValueError(f"reward function {name!r} returned {len(values)} rewards for {count} completions; return "
                         "exactly one per completion")
    for i, v in enumerate(values):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) or math.isnan(float(v))
                              or math.isinf(float(v))):
            raise ValueError(f"reward function {name!r} returned {v!r} for completion {i}; return a finite number "
                             "(or None: not scored by this function)")
    return [math.nan if v is None else float(v) for v in values]


def weighted(rewards: torch.Tensor, weights: Sequence[float] | None) -> torch.Tensor:
    """(completions,) the weighted sum over the functions (NaN ones left out; NaN where all are)."""
    w = torch.ones(rewards.shape[1], dtype=rewards.dtype) if weights is None else torch.tensor(weights, dtype=rewards.dtype)
    total = (rewards * w).nansum(dim=1)
    return total.masked_fill(torch.isnan(rewards).all(dim=1), math.nan)


def advantages(rewards: torch.Tensor, *, group: int, scale: str, batch_std: torch.Tensor | None = None
               ) -> torch.Tensor:
    """TRL's: each reward minus its group's mean, divided by (std + 1e-4) of the group ("group"), or of the whole
    global batch (`batch_std`, "batch"), or not ("none"); 0 for a completion no function scored."""
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    adv = rewards - mean
    if scale == "group":
        adv = adv / (nanstd(grouped, dim=1).repeat_interleave(group) + 1e-4)
    elif scale == "batch":
        adv = adv / (batch_std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


def nanstd(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """TRL's nanstd: the unbiased standard deviation of the non-NaN values."""
    mean = torch.nanmean(t, dim=dim, keepdim=dim is not None)
    variance = torch.nanmean((t - mean) ** 2, dim=dim)
    count = (~torch.isnan(t)).sum(dim=dim)
    return torch.sqrt(variance * count / (count - 1))
