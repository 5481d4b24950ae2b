"""Message helpers every part of jdp may use: user input quoted in an error, cut to a readable length."""
from __future__ import annotations

MAX_SHOWN = 200  # characters of user input an error message quotes


def shorten(text: str, limit: int = MAX_SHOWN) -> str:
    """`text`, cut to `limit` characters ending in "...", so that an error quoting user input stays readable."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def quoted(value) -> str:
    """`repr(value)` cut to MAX_SHOWN characters (a long string is cut before its repr is built)."""
    if isinstance(value, str):
        value = value[:MAX_SHOWN + 1]  # a longer one is cut anyway
    return shorten(repr(value))


__all__ = ["MAX_SHOWN", "quoted", "shorten"]
