"""Typed, frozen config sections: each field coerced, type-checked and range-checked on construction.

A section is a frozen dataclass deriving from `Section`, with a `Rule` per field. Types are strict:
an int field takes ints only (not bools, not 1.5), a float field ints or floats, a tuple field a
list of ints, `X | None` also null. A bad value raises `ConfigError`, one sentence naming the
dotted key and what it accepts: "optim.lr must be a positive number, got -1."

PyYAML follows YAML 1.1, where `3e-4` (no dot) is a string, not a float; float fields therefore
also accept a string in exponent notation. Integer fields stop at `Rule.top` (2**31 - 1: jax computes
with 32-bit integers).

`parse_yaml` / `read_yaml` read a config as `yaml.safe_load` does, within limits that keep a hostile
or mistyped file from running for minutes or replacing a section silently (see `_ConfigLoader`);
every message quotes user input cut to MAX_SHOWN characters.
"""
from __future__ import annotations

import ast
import inspect
import math
import numbers
import os
import re
import textwrap
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import yaml

from jdp.text import MAX_SHOWN, quoted, shorten


class ConfigError(ValueError):
    """A config that cannot run, with one sentence naming the key and the values it accepts."""


@dataclass(frozen=True)
class Rule:
    """What a field accepts: `desc` completes "KEY must be ..."; `ok` tests the type-checked value.

    `schema` says what `ok` tests as JSON Schema keywords on the value (`jdp config schema`): e.g.
    {"minimum": 1}, {"enum": [...]}, {"items": {...}} for a list; a rule without them still gets
    its field's type in the schema, and `desc` in its description.
    """

    desc: str
    ok: Callable[[Any], bool] = lambda v: True
    top: int = 2**31 - 1  # the largest integer (or list item) taken: jax computes with int32
    schema: dict = field(default_factory=dict, compare=False)


def one_of(choices: Iterable) -> Rule:
    """A field that takes one of `choices`."""
    choices = tuple(choices)
    return Rule(f"one of {', '.join(map(str, choices))}", lambda v: v in choices, schema={"enum": list(choices)})


def or_null(rule: Rule) -> Rule:
    """A field that takes null, or what `rule` takes."""
    return Rule(f"null or {rule.desc}", rule.ok, rule.top, rule.schema)  # None never reaches `ok`


POSITIVE_INT = Rule("a positive integer", lambda v: v >= 1, schema={"minimum": 1})
COUNT = Rule("an integer of at least 0", lambda v: v >= 0, schema={"minimum": 0})
SEED = Rule(COUNT.desc, COUNT.ok, top=2**63 - 1, schema=COUNT.schema)  # jax.random.key and numpy take 64-bit seeds
POSITIVE = Rule("a positive number", lambda v: v > 0, schema={"exclusiveMinimum": 0})
NON_NEGATIVE = Rule("a number of at least 0", lambda v: v >= 0, schema={"minimum": 0})
UNIT = Rule("a number in [0, 1)", lambda v: 0 <= v < 1, schema={"minimum": 0, "exclusiveMaximum": 1})
FRACTION = Rule("a number strictly between 0 and 1", lambda v: 0 < v < 1,
                schema={"exclusiveMinimum": 0, "exclusiveMaximum": 1})
BOOL = Rule("true or false")
WIDTHS = Rule("a list of positive integers", lambda v: all(w >= 1 for w in v), schema={"items": {"minimum": 1}})
TWO_WIDTHS = Rule("a list of two positive integers", lambda v: len(v) == 2 and all(w >= 1 for w in v),
                  schema={"items": {"minimum": 1}, "minItems": 2, "maxItems": 2})
NPZ = Rule("the path of a .npz file", lambda v: v.lower().endswith(".npz"), schema={"pattern": r"\.[nN][pP][zZ]$"})
PATH = Rule("a file path", lambda v: bool(v), schema={"minLength": 1})

_BAD = object()  # _coerce's "wrong type"
# YAML 1.1 reads 3e-4 as a string; these are the numbers it misses (YAML 1.2's float syntax).
_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(tp, value):
    """`value` as type `tp` (bool, int, float, str, tuple[int, ...], or one of those | None, or int | str),
    else _BAD."""
    args = typing.get_args(tp)
    if type(None) in args:
        if value is None:
            return None
        tp = next(a for a in args if a is not type(None))
    elif args and typing.get_origin(tp) is not tuple:  # a union such as int | str: the first type that takes it
        return next((v for v in (_coerce(a, value) for a in args) if v is not _BAD), _BAD)
    if tp is bool:
        return value if isinstance(value, bool) else _BAD
    if tp is int:
        return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else _BAD
    if tp is float:
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            value = float(value)
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            return _BAD
        try:
            value = float(value)
        except OverflowError:  # an int beyond float's range
            return _BAD
        return value if math.isfinite(value) else _BAD
    if tp is str:
        return value if isinstance(value, str) else _BAD
    if typing.get_origin(tp) is tuple:
        if not isinstance(value, (list, tuple)):
            return _BAD
        items = tuple(_coerce(int, v) for v in value)
        return _BAD if _BAD in items else items
    raise TypeError(f"jdp.run.sections has no coercion for type {tp!r}.")


def _show(value) -> str:
    """A value as the YAML user wrote it: null, true/false, 'text', 1.5, [1, 2]; cut to MAX_SHOWN characters."""
    return shorten(_yaml_text(value, MAX_SHOWN))


def _yaml_text(value, budget: int) -> str:
    """_show's text, built only until it is longer than `budget` (the rest would be cut)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and value.bit_length() > 4 * budget:  # more digits than shown (and than repr allows)
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, (list, tuple)):
        text = "["
        for i, v in enumerate(value):
            if len(text) > budget:  # each nested list adds "[": the recursion ends within `budget` levels
                return text + "..."
            text += (", " if i else "") + _yaml_text(v, budget - len(text))
        return text + "]"
    return quoted(value)


def _too_large(value, top: int) -> bool:
    """Whether an int, or an item of a tuple of ints, exceeds `top`."""
    items = value if isinstance(value, tuple) else (value,)
    return any(isinstance(v, int) and not isinstance(v, bool) and v > top for v in items)


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
            if _too_large(value, rule.top):
                raise ConfigError(f"{self._section}.{f.name} must be {rule.desc} up to {rule.top}, got {_show(raw)}.")
            object.__setattr__(self, f.name, value)


MAX_DEPTH = 16  # nesting levels a YAML config may use (it needs 4: section, key, list, item)
MAX_VALUES = 10_000  # values (keys, items, scalars) a YAML config may hold, each alias counted at its full size
INT64 = 2**63  # YAML integers must lie in [-INT64, INT64): beyond it they overflow whatever reads them
_MERGE = "tag:yaml.org,2002:merge"


class _ConfigLoader(yaml.SafeLoader):
    """yaml.SafeLoader within a config's limits: each refusal is a ConfigError naming the line.

    PyYAML alone lets a repeated key replace the first (two `optim:` blocks: the first is lost
    silently), recurses once per nesting level (RecursionError), expands aliases without bound (nine
    nested lists of nine aliases are 10^9 values: a "billion laughs" file), and reads integers of
    any size. Sizes are counted while composing, before anything is constructed.
    """

    def __init__(self, text: str, source: str):
        super().__init__(text)
        self.source, self.depth = source, 0

    def refuse(self, problem: str):
        raise ConfigError(f"{self.source}: {problem}.")

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if node is not None and not hasattr(node, "jdp_size"):  # still being composed: it holds this alias
                self.refuse(f"the alias *{shorten(event.anchor)} at line {_line(event)} refers to a value that "
                            f"contains it; a config cannot be recursive")
            return super().compose_node(parent, index)
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self.refuse(f"the value at line {_line(self.peek_event())} is nested more than {MAX_DEPTH} levels "
                        f"deep; a config needs 4 (section, key, list, item)")
        node = super().compose_node(parent, index)
        self.depth -= 1
        self._measure(node)
        return node

    def _measure(self, node) -> None:
        """Set `node.jdp_size` and `jdp_depth` (aliases expanded); refuse a repeated key or a limit passed."""
        children = node.value if isinstance(node, yaml.SequenceNode) else []
        if isinstance(node, yaml.MappingNode):
            first = {}
            for key, value in node.value:
                children += (key, value)
                if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE:  # `<<` merges may repeat keys
                    seen = first.setdefault((key.tag, key.value), key)
                    if seen is not key:
                        self.refuse(f"the key {quoted(key.value)} appears twice in one mapping, at lines "
                                    f"{_line(seen)} and {_line(key)}; write it once (YAML would keep only the last)")
        node.jdp_size = 1 + sum(c.jdp_size for c in children)
        node.jdp_depth = 1 + max((c.jdp_depth for c in children), default=0)
        if node.jdp_size > MAX_VALUES:
            self.refuse(f"the value at line {_line(node)} holds {node.jdp_size} values (aliases counted in full); "
                        f"a config may hold at most {MAX_VALUES}")
        if node.jdp_depth > MAX_DEPTH:
            self.refuse(f"the value at line {_line(node)} is nested {node.jdp_depth} levels deep through its "
                        f"aliases; a config may nest at most {MAX_DEPTH}")

    def construct_yaml_int(self, node):
        digits = node.value.replace("_", "")
        value = super().construct_yaml_int(node) if len(digits) <= 70 else None  # int64 takes <= 67 characters
        if value is None or not -INT64 <= value < INT64:
            self.refuse(f"the integer {shorten(digits)} at line {_line(node)} does not fit in 64 bits; integers "
                        f"must lie between {-INT64} and {INT64 - 1}")
        return value


def _line(item) -> int:
    """The 1-based line where a YAML node or event starts."""
    return item.start_mark.line + 1


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)


def parse_yaml(text: str, source: str):
    """The data of the YAML document `text`, as `yaml.safe_load` reads it, within a config's limits.

    Raises ConfigError, starting with `source`, for a key repeated in one mapping, nesting deeper
    than MAX_DEPTH, more than MAX_VALUES values (aliases expanded), a recursive alias or an integer
    beyond 64 bits; yaml.YAMLError for text that is not YAML.
    """
    loader = _ConfigLoader(text, source)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def parse_override(text, check_key: Callable[[str, str], None]) -> tuple[str, str, Any]:
    """`"section.key=value"` as `(section, key, value)`, the value read as YAML (numbers, bools, lists, null).

    `check_key(section, key)` raises for a key the config does not have, before the value is read.
    """
    if not isinstance(text, str) or "=" not in text:
        raise ConfigError(f"override {quoted(text)} has no '='; write section.key=value, e.g. optim.lr=3e-4.")
    dotted, _, raw = text.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not (section and dot and key) or "." in key:
        raise ConfigError(f"override {quoted(text)} must name one key as section.key, e.g. optim.lr=3e-4.")
    check_key(section, key)
    if not raw.strip():
        raise ConfigError(f"override {quoted(text)} has no value; write {section}.{key}=null for none.")
    try:
        return section, key, parse_yaml(raw, f"the override of {section}.{key}")
    except yaml.YAMLError:
        raise ConfigError(f"override {quoted(text)} has a value that is not valid YAML: {quoted(raw)}.") from None


def read_yaml(path: str):
    """The data of the YAML file `path` (`parse_yaml`); ConfigError for a missing, unreadable or invalid file."""
    if not os.path.exists(path):
        raise ConfigError(f"config file {quoted(path)} does not exist.")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {quoted(path)} is not a file.")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {quoted(path)} cannot be read ({shorten(str(e))}).") from None
    source = shorten(path)
    try:
        return parse_yaml(text, source)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(e.problem or e.context or "syntax error").split())
        raise ConfigError(f"{source}: invalid YAML{where}: {shorten(problem)}.") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: invalid YAML: {shorten(' '.join(str(e).split()))}.") from None


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal right after it in the class body), by field name."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs
