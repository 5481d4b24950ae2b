"""Every ```python block of README.md and of every docs page runs as written, as a user would run it.

One fresh process per page (importing jax costs ~1 s); inside it each block runs on its own, in a
new namespace, so a block that uses a name it does not define fails. Blocks ask for the fake
devices they need (`jdp.cpu.use_cpu_devices(4)`); the process starts without the suite's 8.
Every console line the pages quote is checked against what jdp prints (tests/console_quotes.py).
"""
import difflib
import os
import re
import subprocess
import sys

import pytest

import console_commands
import console_quotes
from benchmarks.common import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def pages() -> list[str]:
    """README.md and every Markdown page under docs/ (the build's output excluded), relative to the repo."""
    found = ["README.md"]
    for where, dirs, files in os.walk(DOCS):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("_build", ".")))
        found += sorted(os.path.relpath(os.path.join(where, f), ROOT) for f in files if f.endswith(".md"))
    return found


def blocks(page: str) -> list[str]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return FENCE.findall(f.read())


RUNNER = """
import sys
page, blocks = sys.argv[1], sys.stdin.read().split("\\0")
for i, code in enumerate(blocks):
    print(f"--- {page} block {i + 1} of {len(blocks)}", flush=True)
    exec(compile(code, f"{page} block {i + 1}", "exec"), {"__name__": "__main__"})
print("--- all blocks ran", flush=True)
"""
WITH_CODE = [p for p in pages() if blocks(p)]


def test_the_pages_hold_the_examples():
    """The README and the tutorials keep runnable examples (a fence typo would hide them from this test)."""
    assert len(blocks("README.md")) >= 3
    for page in ("quickstart", "nnx", "testing", "step", "accumulation", "mixed-precision", "zero", "why-average"):
        assert blocks(f"docs/{page}.md"), page
    for page in pages():
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read()
        assert len(re.findall(r"^```python", text, re.M)) == len(blocks(page)), f"{page}: an unclosed python block"


@pytest.mark.parametrize("page", WITH_CODE)
def test_every_python_block_runs_as_written(page, tmp_path):
    env = child_env("JAX_PLATFORMS")
    env["JAX_PLATFORMS"] = "cpu"
    run = subprocess.run([sys.executable, "-W", "error", "-c", RUNNER, page], input="\0".join(blocks(page)),
                         text=True, capture_output=True, cwd=tmp_path, env=env, timeout=600)
    assert run.returncode == 0 and "--- all blocks ran" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]


def _reference():
    sys.path.insert(0, os.path.join(DOCS, "_ext"))
    try:
        import jdp_reference
    finally:
        sys.path.pop(0)
    return jdp_reference


def test_config_reference_names_every_field_with_its_rule():
    """The generated page covers the schema as it is: every section and field, its default and its rule."""
    from dataclasses import fields

    from jdp import config

    ref = _reference()
    page = ref.config_reference()
    for name, cls in config.SECTIONS.items():
        for f in fields(cls):
            row = next(line for line in page.splitlines() if line.startswith(f"| `{name}.{f.name}` |"))
            assert cls._rules[f.name].desc.replace("|", "\\|") in row, row
    assert "| `train.log_every` | `int` | `50` |" in page
    assert "| `optim.lr` |" in page and "fixed" in next(l for l in page.splitlines() if l.startswith("| `optim.lr`"))
    assert "may change" in next(l for l in page.splitlines() if l.startswith("| `parallel.devices`"))
    for page_name, marker in (("reference/config.md", ref.CONFIG_MARKER), ("reference/config.md", ref.CONFIGS_MARKER),
                              ("reference/cli.md", ref.CLI_MARKER)):
        with open(os.path.join(DOCS, page_name), encoding="utf-8") as f:
            assert marker in f.read(), (page_name, marker)
    assert "### `char_gpt`" in ref.shipped_configs() and "--workdir" in ref.cli_reference()


def test_docstrings_become_restructured_text_that_says_the_same():
    ref = _reference()
    lines = ["Build it:", "", "    step = make(x)", "    step(state)", "", "Returns `TrainStep`s, |x| wide."]
    ref.plain_text_docstring(None, "function", "f", None, {}, lines)
    assert lines[:5] == ["Build it::", "", "    step = make(x)", "    step(state)", ""], lines
    assert lines[5] == "Returns ``TrainStep``\\ s, \\|x\\| wide.", lines


def test_every_file_the_pages_name_exists():
    """A path in the README, CONTRIBUTING.md or a docs page (`jdp/core/step.py`, `configs/char_gpt.yaml`) names a real
    file or folder, so moving one without its documentation fails here. Outputs under benchmarks/results/ are
    written by the commands the pages show, and are not checked."""
    path = re.compile(r"(?<![\w/.])((?:jdp|tests|benchmarks|examples|configs|docs)/[\w./-]*[\w/])")
    missing = []
    for page in [*pages(), "CONTRIBUTING.md"]:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                for found in path.findall(line):
                    if not found.startswith(("benchmarks/results/", "docs/_build")) \
                            and not os.path.exists(os.path.join(ROOT, found)):
                        missing.append(f"{page}:{number}: {found}")
    assert not missing, "\n".join(missing)


def test_docs_build_strictly_and_open_offline(tmp_path):
    """`sphinx-build -W --keep-going -n`: every warning and broken cross-reference fails the build; the built
    pages load nothing from the network, so the site opens offline."""
    out = tmp_path / "html"
    run = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
                          "-d", str(tmp_path / "doctrees"), DOCS, str(out)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    remote = re.compile(r'<(?:script|link|img)[^>]+(?:src|href)="(?:https?:)?//')
    loads = [str(f.relative_to(out)) for f in out.rglob("*.html") if remote.search(f.read_text(encoding="utf-8"))]
    assert not loads, f"these pages load something from the network: {loads}"
    _every_public_name_has_an_entry(out)


PUBLIC = ("jdp", "jdp.nnx", "jdp.linen", "jdp.data", "jdp.testing", "jdp.fsdp", "jdp.zero", "jdp.models")


def _every_public_name_has_an_entry(out):
    """Each name in a public module's `__all__` has an entry (an anchor `module.name`) in the built API
    pages, each public module its page, and no class shows the `(*args, **kwargs)` of a metaclass."""
    import importlib
    import types

    html = "".join(f.read_text(encoding="utf-8") for f in (out / "api").glob("*.html"))
    anchors = set(re.findall(r'id="([^"]+)"', html))
    missing = [f"{m}.{n}" for m in PUBLIC for n in importlib.import_module(m).__all__
               if not isinstance(getattr(importlib.import_module(m), n), types.ModuleType) and f"{m}.{n}" not in anchors]
    assert not missing, f"public names with no entry in the API reference: {missing}"
    assert all(f'id="module-{m}"' in html for m in PUBLIC), [m for m in PUBLIC if f'id="module-{m}"' not in html]
    for name in ("GPT", "MLP", "CNN"):
        signature = re.sub(r"<[^>]+>", "", html[html.index(f'id="jdp.models.{name}"'):][:20000]).split("[source]")[0]
        assert "*args" not in signature and "dtype" in signature, signature[:300]


def test_every_console_line_the_pages_quote_is_what_jdp_prints(tmp_path, monkeypatch, capsys):
    """Each console line quoted in a page's text block or sentence (tests/console_quotes.py finds them)
    is a line jdp prints, word for word: made in this process by the code that prints it, from the
    values the page shows (the `jdp train` run's own lines: the test below)."""
    quoted = [one for block in console_quotes.quotes() if not block.of_the_run
              for one in console_quotes.one_by_one(block)]
    assert len(quoted) >= 20 and {q.page for q in quoted} >= {"docs/reliability.md", "docs/install.md"}
    printed = console_quotes.printed(tmp_path, monkeypatch, capsys)
    closest = lambda q: difflib.get_close_matches(q.lines[0], printed, 1, 0)  # noqa: E731
    wrong = [f"{q.page}:{q.line}: {q.lines[0]}\n  closest printed: {closest(q)}" for q in quoted
             if console_quotes.missing(q, printed)]
    assert not wrong, "\n".join(wrong)


def test_every_command_the_pages_quote_is_one_jdp_takes():
    """Each shell command a page quotes (tests/console_commands.py finds them) is one that works as
    written: a `jdp ...` line parses with jdp's own argument parser, a `python -m MODULE` names a
    module, a `pip install` names extras pyproject.toml defines, and every page builds the wheel with
    the same command. A wrong one is found by that check itself (the cases below)."""
    found = console_commands.every_command()
    assert len(found) >= 150 and sum(c.words[0] == "jdp" for c in found) >= 60
    assert {"docs/training.md", "docs/install.md", "README.md"} <= {c.page for c in found}
    assert console_commands.problems(found) == []
    made_up = [console_commands.Command("p.md", 1, tuple(words.split())) for words in (
        "jdp train --no-such-flag", "jdp trian", "python -m jdp.no_such_module", "pip install .[plots]",
        "jdp memory CONFIG --devices 0")]
    said = console_commands.problems(made_up + [console_commands.Command("q.md", 2, ("pip", "wheel", "."))] * 2
                                     + [console_commands.Command("r.md", 3, ("pip", "wheel", "-w", "dist", "."))])
    assert len(said) == 6 and said[-1].startswith("the wheel is built with 2 different commands"), said
    assert [line.split(": ")[1] for line in said[:5]] == [str(c).split(": ")[1] for c in made_up], said


def test_the_console_lines_the_pages_quote_are_what_jdp_train_prints(tmp_path):
    """Each block of `jdp train`'s output the pages quote (numbers aside; `...` stands for lines left
    out) is lines the command prints one after the other, on a first run or on the rerun, which print
    nothing else (stderr included); so is each part of its lines quoted in a sentence."""
    runs = []
    for _ in range(2):  # the run, then the rerun that finds it complete
        run = subprocess.run([sys.executable, "-m", "jdp.run.cli", "train"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=600, env=child_env())
        assert run.returncode == 0 and run.stderr == "", run.stderr[-2000:]
        runs.append(run.stdout.replace(str(tmp_path), console_quotes.HOME).splitlines())
    quoted = [block for block in console_quotes.quotes() if block.of_the_run]
    assert len(quoted) >= 8 and sum(len(block.lines) for block in quoted) >= 20
    wrong = [f"{q.page}:{q.line}: not printed as quoted: {min(gaps, key=len)}" for q in quoted
             if all(gaps := [console_quotes.missing(q, lines, masked=True) for lines in runs])]
    assert not wrong, "\n".join(wrong) + "\n\nprinted:\n" + "\n\n".join("\n".join(r) for r in runs)
