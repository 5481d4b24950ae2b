"""Argument checks shared by the data modules: one sentence naming the bad value and what is allowed."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def is_int(value) -> bool:
    """Whether `value` is an integer (Python or numpy), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int) -> int:
    """`value` as an int if it is an integer of at least `minimum`; ValueError otherwise."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer of at least {minimum}.")
    return int(value)


def describe(value) -> str:
    """What `value` is, for a message: "an empty dict" or "a <type>"."""
    return "an empty dict" if isinstance(value, Mapping) else f"a {type(value).__name__}"
