"""Reference pages generated from jdp's own objects when the docs are built, so they cannot drift.

A page holds a marker line; on `source-read` the marker is replaced by Markdown built from:

- `<!-- jdp:config-reference -->`: the config schema (`jdp.config.SECTIONS`): every section's
  docstring and, per field, its type, default, what it accepts (the rule that checks it, the same
  words its error message uses), whether a resume may change it (`jdp.config.run_identity`) and
  its docstring; then the whole default config as YAML and the YAML reader's limits.
- `<!-- jdp:shipped-configs -->`: each shipped config (`jdp/configs/`) with its header: what it trains, the
  command that runs it and the result it should reach.
- `<!-- jdp:cli-reference -->`: `jdp --help` and each subcommand's `--help`, from
  `jdp.run.cli.build_parser()`.

It also reads jdp's docstrings as what they are, plain text (`plain_text_docstring`): `code` in
single backticks, examples indented under a line of prose, and Google-style "Args:" sections.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import types
import typing
from dataclasses import MISSING, fields, replace

import yaml

CONFIG_MARKER = "<!-- jdp:config-reference -->"
CLI_MARKER = "<!-- jdp:cli-reference -->"
CONFIGS_MARKER = "<!-- jdp:shipped-configs -->"


def _cell(text: str) -> str:
    """`text` on one line, with the pipes a Markdown table cell must escape."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _type_name(tp) -> str:
    """`int`, `tuple[int, ...]`, `str | None`: a field's annotation as it is written."""
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin is tuple:
        return "tuple[" + ", ".join("..." if a is Ellipsis else _type_name(a) for a in args) + "]"
    return str(tp).replace("typing.", "")


def _yaml_value(value) -> str:
    """A default as a YAML user writes it: null, true, 3e-3, [128], 'mlp'."""
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def _default(field):
    if field.default is not MISSING:
        return field.default
    return field.default_factory() if field.default_factory is not MISSING else None


def _resume_rule(config_mod, dotted: str) -> str:
    """Whether resuming a run may change `dotted`: from the run identity of two configs."""
    section, key = dotted.split(".")
    base = config_mod.Config()
    decaying = replace(base, optim=replace(base.optim, schedule="cosine"))
    inside = [key in config_mod.run_identity(c).get(section, {}) for c in (base, decaying)]
    if all(inside):
        return "fixed"
    if not any(inside):
        return "may change"
    return "fixed unless `optim.schedule` is `'constant'`"


def config_reference() -> str:
    """The config reference as Markdown: one table per section, the default YAML, the reader's limits."""
    from jdp import config as config_mod
    from jdp.run import sections as sections_mod

    out = []
    for name, cls in config_mod.SECTIONS.items():
        docs = config_mod.field_docs(cls)
        hints = typing.get_type_hints(cls)
        rules = getattr(cls, "_rules", {})
        out += [f"## `{name}`", "", f"{_cell(cls.__doc__)} (`{cls.__module__}.{cls.__name__}`)", "",
                "| key | type | default | accepts | on resume | meaning |", "|---|---|---|---|---|---|"]
        for f in fields(cls):
            dotted = f"{name}.{f.name}"
            accepts = rules[f.name].desc if f.name in rules else ""
            out.append(f"| `{dotted}` | `{_cell(_type_name(hints[f.name]))}` | `{_cell(_yaml_value(_default(f)))}` "
                       f"| {_cell(accepts)} | {_resume_rule(config_mod, dotted)} | {_cell(docs.get(f.name, ''))} |")
        out.append("")
    default_yaml = yaml.safe_dump(config_mod.Config().to_dict(), sort_keys=False, default_flow_style=None)
    out += ["## The default config", "",
            "`jdp train` with no config file runs this (`jdp.config.Config().to_dict()`):", "",
            "```yaml", default_yaml.rstrip(), "```", "",
            "## What the YAML reader refuses", "",
            "A config is read as `yaml.safe_load` reads it, within these limits; each refusal is one "
            "sentence naming the line (`jdp.run.sections.parse_yaml`):", "",
            "| limit | value |", "|---|---|",
            f"| nesting levels | at most {sections_mod.MAX_DEPTH} |",
            f"| values (keys, items, scalars), aliases counted in full | at most {sections_mod.MAX_VALUES:,} |",
            f"| integers | from {-sections_mod.INT64:,} to {sections_mod.INT64 - 1:,} (64 bits) |",
            "| a key repeated in one mapping | refused (YAML would keep only the last) |",
            "| an alias that contains itself | refused |", ""]
    return "\n".join(out)


def shipped_configs() -> str:
    """Each shipped config (jdp.run.shipped, as `jdp configs` reads them) as a section: what it trains, its
    "Run:" command, its "Expected result:"."""
    from jdp.run.shipped import shipped_configs as configs

    out = []
    for config in configs():
        out += [f"### `{config.name}`", "", config.summary, "", "```bash", config.run, "```", "",
                f"Expected result: {config.expected}", ""]
    return "\n".join(out)


def cli_reference() -> str:
    """`jdp --help` and each subcommand's help as Markdown text blocks."""
    from jdp.run.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width: make the page the same everywhere
    parser = build_parser()
    out = ["## `jdp`", "", "```text", parser.format_help().rstrip(), "```", ""]
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        out += [f"## `jdp {name}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def _fill_markers(app, docname, source):
    for marker, build in ((CONFIG_MARKER, config_reference), (CONFIGS_MARKER, shipped_configs),
                          (CLI_MARKER, cli_reference)):
        if marker in source[0]:
            source[0] = source[0].replace(marker, build())


SECTION_HEADERS = ("Args:", "Arguments:", "Returns:", "Return:", "Raises:", "Yields:", "Attributes:", "Example:",
                   "Examples:", "Note:", "Notes:")
_CODE = re.compile(r"(?<![`:\\\w])`([^`]+?)`(?![`_])")  # `code`, not ``literal``, :role:`x` or `link`_
_LIST_ITEM = re.compile(r"\s*([-*+]|\d+\.|\(\d+\)) ")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _code(match) -> str:
    """`x` as ``x``, with escaped spaces where a letter touches it (``x``\\ s is reST for `x`s)."""
    text, i, j = match.string, match.start(), match.end()
    before = "\\ " if i and text[i - 1].isalnum() else ""
    after = "\\ " if j < len(text) and text[j].isalnum() else ""
    return f"{before}``{match.group(1)}``{after}"


def _inline(lines: list[str]) -> list[str]:
    """Prose lines with `code` as literals and every other "|" escaped (reST reads |x| as a substitution)."""
    text = _CODE.sub(_code, "\n".join(lines))
    parts = re.split(r"(``.*?``)", text, flags=re.S)
    return "".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts)).split("\n")


def _blocks(lines: list[str]) -> list[str]:
    """Turn each block indented under a prose line into a literal block (text ending "::"), leaving
    list items' continuation lines and Google-style sections as they are."""
    out, prose, prev, literal, section = [], [], None, None, None

    def flush():
        out.extend(_inline(prose))
        prose.clear()

    for line in lines:
        blank, indent = not line.strip(), _indent(line)
        if literal is not None and (blank or indent > literal):
            out.append(line)
            continue
        literal = None
        if not blank:
            if section is not None and indent <= section:
                section = None
            if line.strip() in SECTION_HEADERS:
                section = indent
            elif section is None and prev is not None and indent > _indent(prev) and not _LIST_ITEM.match(prev):
                i = len(prose) - 1 - prose[::-1].index(prev)
                prose[i] = prev + (":" if prev.rstrip().endswith(":") else " ::")
                flush()
                if out[-1].strip():
                    out.append("")  # a literal block starts after a blank line
                out.append(line)
                literal, prev = _indent(prev), None
                continue
            prev = line
        prose.append(line)
    flush()
    return out


def plain_text_docstring(app, what, name, obj, options, lines):
    """jdp's docstrings are plain text: `code` in single backticks, examples indented under a line
    of prose, and Google-style "Args:"/"Returns:" sections in functions and classes. Make them
    reStructuredText that says the same (napoleon for the sections; attribute docstrings such as
    "gpt: the embedding width" are prose, not "type: description")."""
    lines[:] = _blocks(lines)
    if what in ("function", "method", "class", "exception", "module"):
        from sphinx.ext.napoleon import Config, GoogleDocstring

        config = Config(napoleon_use_param=True, napoleon_use_rtype=False)
        lines[:] = GoogleDocstring(lines, config, app, what, name, obj, options).lines()


def constructor_signature(app, what, name, obj, options, signature, return_annotation):
    """A class's real constructor arguments where its metaclass hides them: Flax NNX modules are built
    through the metaclass's `__call__(*args, **kwargs)`, which autodoc would show for GPT, MLP and CNN."""
    import inspect

    if what != "class" or not signature or "*args" not in signature or "__init__" not in vars(obj):
        return None
    try:
        init = inspect.signature(obj.__init__, eval_str=True)  # the modules' string annotations as types
    except NameError:
        init = inspect.signature(obj.__init__)
    params = list(init.parameters.values())[1:]  # without self
    return str(init.replace(parameters=params, return_annotation=inspect.Signature.empty)), return_annotation


def setup(app):
    app.connect("source-read", _fill_markers)
    app.connect("autodoc-process-signature", constructor_signature)
    app.connect("autodoc-process-docstring", plain_text_docstring, priority=400)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
