"""Typed, frozen config sections: each field coerced, type-checked and range-checked on construction.

A section is a frozen dataclass deriving from `Section`, with a `Rule` per field. Types are strict:
an int field takes ints only (not bools, not 1.5), a float field ints or floats, a tuple field a
list of ints, `X | None` also null. A bad value raises `ConfigError`, one sentence naming the
dotted key and what it accepts: "optim.lr must be a positive number, got -1."

PyYAML follows YAML 1.1, where `3e-4` (no dot) is a string, not a float; float fields therefore
also accept a string in exponent notation.
"""
from __future__ import annotations

import ast
import inspect
import math
import numbers
import re
import textwrap
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any, ClassVar


class ConfigError(ValueError):
    """A config that cannot run, with one sentence naming the key and the values it accepts."""


@dataclass(frozen=True)
class Rule:
    """What a field accepts: `desc` completes "KEY must be ..."; `ok` tests the type-checked value."""

    desc: str
    ok: Callable[[Any], bool] = lambda v: True


def one_of(choices: Iterable[str]) -> Rule:
    """A field that takes one of `choices`."""
    choices = tuple(choices)
    return Rule(f"one of {', '.join(choices)}", lambda v: v in choices)


def or_null(rule: Rule) -> Rule:
    """A field that takes null, or what `rule` takes."""
    return Rule(f"null or {rule.desc}", rule.ok)  # None never reaches `ok`


POSITIVE_INT = Rule("a positive integer", lambda v: v >= 1)
COUNT = Rule("an integer of at least 0", lambda v: v >= 0)
POSITIVE = Rule("a positive number", lambda v: v > 0)
NON_NEGATIVE = Rule("a number of at least 0", lambda v: v >= 0)
UNIT = Rule("a number in [0, 1)", lambda v: 0 <= v < 1)
FRACTION = Rule("a number strictly between 0 and 1", lambda v: 0 < v < 1)
BOOL = Rule("true or false")
WIDTHS = Rule("a list of positive integers", lambda v: all(w >= 1 for w in v))
TWO_WIDTHS = Rule("a list of two positive integers", lambda v: len(v) == 2 and all(w >= 1 for w in v))
NPZ = Rule("the path of a .npz file", lambda v: v.lower().endswith(".npz"))

_BAD = object()  # _coerce's "wrong type"
# YAML 1.1 reads 3e-4 as a string; these are the numbers it misses (YAML 1.2's float syntax).
_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(tp, value):
    """`value` as type `tp` (bool, int, float, str, tuple[int, ...], or one of those | None), else _BAD."""
    args = typing.get_args(tp)
    if type(None) in args:
        if value is None:
            return None
        tp = next(a for a in args if a is not type(None))
    if tp is bool:
        return value if isinstance(value, bool) else _BAD
    if tp is int:
        return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else _BAD
    if tp is float:
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            value = float(value)
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        return _BAD
    if tp is str:
        return value if isinstance(value, str) else _BAD
    if typing.get_origin(tp) is tuple:
        if not isinstance(value, (list, tuple)):
            return _BAD
        items = tuple(_coerce(int, v) for v in value)
        return _BAD if _BAD in items else items
    raise TypeError(f"jdp.sections has no coercion for type {tp!r}.")


def _show(value) -> str:
    """A value as the YAML user wrote it: null, true/false, 'text', 1.5, [1, 2]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


class Section:
    """Base of the config sections: type-checks, coerces and range-checks every field on construction."""

    _section: ClassVar[str]
    _rules: ClassVar[dict[str, Rule]]

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            raw = getattr(self, f.name)
            value = _coerce(hints[f.name], raw)
            rule = self._rules[f.name]
            if value is _BAD or (value is not None and not rule.ok(value)):
                raise ConfigError(f"{self._section}.{f.name} must be {rule.desc}, got {_show(raw)}.")
            object.__setattr__(self, f.name, value)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal right after it in the class body), by field name."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs
