"""dtype names: the one table between what users and config.json spell ("bfloat16", "bf16") and torch dtypes.

    resolve_dtype("bf16", config)       # torch.bfloat16; None / "auto": the config's torch_dtype (float32 if none)
    dtype_name(torch.bfloat16)          # "bfloat16", as config.json's torch_dtype spells it

A leaf that imports torch only when a dtype is resolved, so the CLI's flags (`--dtype`, whose choices are NAMES)
are defined before torch is imported.
"""
from __future__ import annotations

from typing import Any

# The parameter dtypes a model is built, loaded or saved in: torch's attribute names (config.json's spelling).
NAMES = ("float32", "float64", "bfloat16", "float16")
ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def canonical_name(name: str) -> str:
    """NAMES' spelling of `name` ("bf16" -> "bfloat16"); anything else unchanged (argparse's `type=`: an alias
    passes its choices, an unknown name is refused by them)."""
    return ALIASES.get(name, name)


def dtype_name(dtype: Any) -> str:
    """The name config.json writes for a torch dtype (torch.bfloat16 -> "bfloat16")."""
    return str(dtype).removeprefix("torch.")


def resolve_dtype(dtype: Any, config: Any) -> Any:
    """The torch dtype of `dtype` (a torch.dtype, a name of NAMES or ALIASES, "torch.bfloat16"); None / "auto": the
    checkpoint's own dtype from `config` (its torch_dtype or dtype; float32 if it names none). ValueError for any
    other name."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        dtype = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None) or "float32"
        if isinstance(dtype, torch.dtype):
            return dtype
    name = canonical_name(dtype_name(dtype))
    if name not in NAMES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(set(NAMES) | set(ALIASES))} or a "
                         "torch.dtype")
    return getattr(torch, name)
