"""The configs that ship inside the package (`jdp/configs/*.yaml`), addressable by name.

`jdp train char_gpt` trains the shipped `char_gpt.yaml` wherever jdp is installed; a path to a
YAML file works as before. The rule: a path that is a file is a config file (it wins over a shipped
name); a directory is never a config, so a shipped name wins over a directory of that name (a run's
own workdir, `jdp train digits_mlp --workdir digits_mlp`). `jdp configs` lists
them with the result each should reach: every shipped config's header (its leading `#` lines)
says what it trains, then `# Run: <the command>` and `# Expected result: <measured>` (continued on
lines that start with `#   `). Nothing here imports jax.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

from jdp.run.sections import ConfigError
from jdp.text import quoted

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


@dataclass(frozen=True)
class ShippedConfig:
    """One shipped config: its name, file and what its header says."""

    name: str  # the file name without .yaml: `jdp train NAME`
    path: str
    summary: str  # what it trains: the header's lines before `# Run:`
    run: str  # the command that runs it
    expected: str  # the result it should reach, as measured when it was written


def _header(path: str) -> list[str]:
    """The file's leading comment lines, without their `#`."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    end = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    return [line[1:] for line in lines[:end]]


def _labelled(header: list[str], label: str) -> str:
    """The text after `# label` with its continuation lines (those indented by more than one space)."""
    for i, line in enumerate(header):
        if line.strip().startswith(label):
            rest = [line.strip()[len(label):].strip()]
            rest += [more.strip() for more in itertools.takewhile(lambda x: x.startswith("  "), header[i + 1:])]
            return " ".join(rest)
    return ""


def shipped_config(path: str) -> ShippedConfig:
    """The shipped config in `path`, read from its header."""
    header = _header(path)
    run_at = next((i for i, line in enumerate(header) if line.strip().startswith("Run:")), len(header))
    return ShippedConfig(os.path.splitext(os.path.basename(path))[0], path,
                         " ".join(line.strip() for line in header[:run_at]), _labelled(header, "Run:"),
                         _labelled(header, "Expected result:"))


def shipped_configs() -> list[ShippedConfig]:
    """Every shipped config, by name."""
    names = sorted(f for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))
    return [shipped_config(os.path.join(CONFIG_DIR, f)) for f in names]


def resolve_config(arg: str | None) -> str | None:
    """The YAML file `jdp train ARG` reads: `arg` itself when it is a file; else the shipped config
    named `arg` (`char_gpt`, `char_gpt.yaml`, or `configs/char_gpt.yaml` as the docs of a checkout
    write it), even where a directory of that name exists (a directory is never a config). ConfigError
    naming `arg` and the shipped names when it is neither."""
    if arg is None or os.path.isfile(arg) or (os.path.exists(arg) and not os.path.isdir(arg)):
        return arg  # a file, or something else that is not a directory (read_yaml names what it is)
    name = os.path.basename(arg) if os.path.dirname(arg) == "configs" else arg
    name = name[:-len(".yaml")] if name.endswith(".yaml") else name
    if os.sep not in name and "/" not in name and os.path.isfile(os.path.join(CONFIG_DIR, name + ".yaml")):
        return os.path.join(CONFIG_DIR, name + ".yaml")
    names = ", ".join(c.name for c in shipped_configs())
    if os.path.isdir(arg):
        raise ConfigError(f"config {quoted(arg)} is a directory, and a directory is never a config; give a YAML file "
                          f"or the name of a shipped config: {names} (jdp configs lists them).")
    raise ConfigError(f"config {quoted(arg)} is neither a file nor a shipped config; the shipped ones are {names} "
                      f"(jdp configs lists them).")


def format_configs(configs: list[ShippedConfig]) -> str:
    """The text `jdp configs` prints: each config's name and what it trains (its header up to the first
    ": "), the command that runs it and the result it should reach."""
    blocks = [f"{c.name}: {c.summary.split(': ')[0]}\n  run:      {c.run}\n  expected: {c.expected}" for c in configs]
    return "\n\n".join(blocks) + "\n"


__all__ = ["CONFIG_DIR", "ShippedConfig", "format_configs", "resolve_config", "shipped_config", "shipped_configs"]
