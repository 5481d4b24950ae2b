"""The config as a JSON Schema (draft 2020-12), generated from its sections: `jdp config schema`.

Editors use it for completion, hover text and checks as you type (yaml-language-server: a
`# yaml-language-server: $schema=jdp.schema.json` first line, or `yaml.schemas` in VS Code's
settings). Every field comes from the section dataclasses of `jdp.run.config_sections`: its type from
the annotation, its default, its docstring as the description, and its allowed values from its
`jdp.run.sections.Rule` (`Rule.schema`). A field added to a section appears here with no other change.

What the schema cannot say: the checks across fields (`jdp.config.validate`: model × dataset, the
batch divisible by accum_steps × devices, ...), and the range of a number written as a string in
exponent notation (YAML 1.1 reads `3e-4` as the string "3e-4", which jdp takes as a number).
"""
from __future__ import annotations

import inspect
import typing
from dataclasses import MISSING, fields

from jdp.run.config_sections import SECTIONS
from jdp.run.sections import field_docs

DRAFT = "https://json-schema.org/draft/2020-12/schema"
# What YAML 1.1 leaves a string and jdp reads as a float (`jdp.run.sections._EXPONENT`).
EXPONENT = r"^\s*[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+\s*$"


def _type_schema(tp, rule) -> dict:
    """The JSON Schema of an annotation (bool, int, float, str, tuple[int, ...], X | None, int | str) under
    `rule` (whose keywords each type's branch keeps: JSON Schema applies "minimum" to numbers only,
    "pattern" to strings only)."""
    args = typing.get_args(tp)
    if type(None) in args:
        inner = _type_schema(next(a for a in args if a is not type(None)), rule)
        return {"anyOf": [inner, {"type": "null"}]}
    if args and typing.get_origin(tp) is not tuple:
        return {"anyOf": [_type_schema(a, rule) for a in args]}
    if tp is bool:
        return {"type": "boolean", **rule.schema}
    if tp is int:
        return {"type": "integer", "maximum": rule.top, **rule.schema}
    if tp is float:
        return {"anyOf": [{"type": "number", **rule.schema}, {"type": "string", "pattern": EXPONENT}]}
    if tp is str:
        return {"type": "string", **rule.schema}
    if typing.get_origin(tp) is tuple:
        schema = {"type": "array", **rule.schema}
        schema["items"] = {"type": "integer", "maximum": rule.top, **rule.schema.get("items", {})}
        return schema
    raise TypeError(f"jdp.run.config_schema has no JSON Schema for type {tp!r}.")


def _default(f):
    value = f.default_factory() if f.default is MISSING else f.default
    return list(value) if isinstance(value, tuple) else value


def section_schema(cls: type) -> dict:
    """The JSON Schema of one section (`jdp.run.config_sections.ModelConfig`, ...): an object of its fields."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    properties = {}
    for f in fields(cls):
        rule = cls._rules[f.name]
        doc = docs.get(f.name, "")
        properties[f.name] = {**_type_schema(hints[f.name], rule), "default": _default(f),
                              "description": f"{doc}\n\nMust be {rule.desc}.".strip()}
    return {"type": ["object", "null"], "description": inspect.getdoc(cls), "properties": properties,
            "additionalProperties": False}


def config_schema() -> dict:
    """The JSON Schema (draft 2020-12) of a `jdp train` YAML config: the five sections, each field
    with its type, default, allowed values and docstring; unknown sections and keys are refused."""
    properties = {name: section_schema(cls) for name, cls in SECTIONS.items()}
    return {"$schema": DRAFT, "title": "jdp config",
            "description": "A jdp train config (YAML): sections model, data, optim, parallel, train; "
                           "every key may be left out and keeps its default.",
            "type": ["object", "null"], "properties": properties, "additionalProperties": False}
