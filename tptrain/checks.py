"""Argument checks every layer shares. A leaf that imports nothing (the torch-free config and CLI paths use it).

    check_positive_int(tp_size, "tp_size")      # ValueError: "tp_size must be a positive int, got 0"
"""
from __future__ import annotations


def is_positive_int(value: object) -> bool:
    """An int >= 1, and not a bool (True is an int to Python, never a size to a user)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_positive_int(value: object, name: str, *, what: str = "") -> None:
    """ValueError naming the argument (`name`; `what` says what it is) unless `value` is a positive int."""
    if not is_positive_int(value):
        raise ValueError(f"{name} must be a positive int{what}, got {value!r}")
