"""The shell commands the docs quote, found in the pages, and what checks each.

`commands()` finds every command a page gives: each line of a ```bash (```sh, ```shell) block and
each `$ ` line of a ```console block (a `\\` continues a line; `&&`, `;`, `|` and `&` separate
commands), and each code span inside a sentence that starts with `jdp `, `pip ` or `python -m `.
`problems()` says what is wrong with them: a `jdp ...` command that jdp's own argument parser
(`jdp.run.cli.build_parser`) refuses, a `python -m MODULE` that names no module, a `pip install`
of an extra that pyproject.toml does not define, or the wheel built with other commands on other
pages. Nothing is run: parsing is all.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import tomllib
from dataclasses import dataclass

from console_quotes import INLINE, ROOT, pages, read

SHELL = ("bash", "sh", "shell")
SPAN = re.compile(r"`((?:\.venv/bin/)?(?:jdp|pip|python3? -m) [^`]+)`")
# A page's placeholders, as jdp's parser would take them (an int where the option wants one).
PLACEHOLDERS = {"N": "4", "S": "3"}


@dataclass(frozen=True)
class Command:
    """One command a page quotes: where, and its words (a `.venv/bin/` prefix and a comment left out)."""

    page: str
    line: int
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {' '.join(self.words)}"


def _split(page: str, number: int, text: str) -> list[Command]:
    """The commands of one shell line: split at `&&`, `;`, `|`, `&`, its `# comment` and redirections
    (`> FILE`) dropped."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split, lexer.commenters = True, "#"
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote: not a command line
        return []
    found, words, redirected = [], [], False
    for token in [*tokens, ";"]:
        if token and set(token) <= set(";&|()"):
            if words:
                found.append(Command(page, number, tuple(words)))
            words, redirected = [], False
        elif token and set(token) <= set("<>") or redirected:
            redirected = True  # `> FILE`: the shell's, not the command's
        elif not words and re.fullmatch(r"\w+=.*", token):  # VAR=value before the command
            continue
        else:
            words.append(re.sub(r"^(?:\$REPO/)?\.venv/bin/", "", token))
    return found


def commands(page: str) -> list[Command]:
    """Every command `page` quotes, in order: shell blocks' lines, console blocks' `$ ` lines, and code
    spans of sentences that start `jdp `, `pip ` or `python -m ` (a printed line it quotes aside)."""
    found, fence, pending, quoted = [], None, None, {quote for _, quote in INLINE}
    for number, line in enumerate(read(page).splitlines(), 1):
        text = line.strip()
        if text.startswith("```"):
            fence = text[3:].strip() if fence is None else None
            continue
        if fence in SHELL or fence == "console" and (text.startswith("$ ") or pending):
            text = text.removeprefix("$ ")
            start, text = (pending[0], pending[1] + " " + text) if pending else (number, text)
            pending = (start, text[:-1]) if text.endswith("\\") else None
            if not pending:
                found += _split(page, start, text)
        elif fence is None:
            found += [c for span in SPAN.findall(line) if span not in quoted for c in _split(page, number, span)]
    return found


def _parses(words: tuple[str, ...]) -> str | None:
    """None if jdp's parser takes `jdp WORDS` (a `--help` or `--version` exit counts), else what it said.
    A span that only names a command (`jdp plot`, `jdp data prepare-tokens`) must name a real one."""
    from jdp.run.cli import build_parser

    parser, argv = build_parser(), [PLACEHOLDERS.get(w, w) for w in words[1:]]
    if argv and all(re.fullmatch(r"[a-z][a-z-]*", w) for w in argv):  # names a (sub)command
        for word in argv:
            choices = next((a.choices for a in parser._actions if a.choices and hasattr(a, "add_parser")), None)
            if not choices or word not in choices:
                return None if not choices else f"no command {word!r} (there are {sorted(choices)})"
            parser = choices[word]
        return None
    said = io.StringIO()
    with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(argv)
        except SystemExit as end:
            return None if end.code == 0 else said.getvalue().strip().splitlines()[-1]
    return None


def _extras() -> set[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return set(tomllib.load(f)["project"]["optional-dependencies"])


def problems(found: list[Command]) -> list[str]:
    """What is wrong with the commands `found`, one sentence each ([] if nothing)."""
    wrong, extras, wheels = [], _extras(), {}
    for c in found:
        name, rest = c.words[0], c.words[1:]
        if name == "jdp":
            if (said := _parses(c.words)) is not None:
                wrong.append(f"{c}: jdp's parser refuses it: {said}")
        elif name in ("python", "python3") and rest[:1] == ("-m",) and len(rest) > 1:
            module = re.sub(r"\.[A-Z]+$", "", rest[1])  # jdp.examples.NAME: the package must exist
            if importlib.util.find_spec(module) is None:
                wrong.append(f"{c}: no module {rest[1]!r}")
        if name == "pip" or name in ("python", "python3") and rest[:2] == ("-m", "pip"):
            words = c.words[c.words.index("pip") if "pip" in c.words else 2:]
            for extra in re.findall(r"(?:^|\.|jdp-train)\[([\w,-]+)\]", " ".join(words)):
                if unknown := set(extra.split(",")) - extras:
                    wrong.append(f"{c}: no extra {sorted(unknown)} in pyproject.toml (there are {sorted(extras)})")
            if words[1:2] == ("wheel",):
                wheels.setdefault(" ".join(words), []).append(str(c))
    if len(wheels) > 1:
        wrong.append(f"the wheel is built with {len(wheels)} different commands: {wheels}")
    return wrong


def every_command() -> list[Command]:
    """The commands of README.md, CONTRIBUTING.md and every docs page."""
    return [c for page in pages() for c in commands(page)]
