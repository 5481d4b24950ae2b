"""The console lines the docs quote, found in the pages, and the lines jdp prints for them.

`blocks()` finds every block of quoted console output in README.md, CONTRIBUTING.md and docs/: a
```text or ```console block or one with no language (a line `...` stands for lines left out), and
the lines after a `$ ` command in a ```bash block. `INLINE` and `RUN_INLINE` list the quotes inside
sentences, which no fence marks. `printed()` makes the lines jdp prints for every quote but those of
the `jdp train` run itself (`of_the_run`, checked against a real run in tests/test_docs.py), in this
process and without training a step: through `jdp.run.cli.main` where the command prints the line,
with the error it reports built by the function the program builds it with, from the page's values.
"""
from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The first lines of `jdp train`'s own output: the blocks that start so are checked against a real run.
RUN_STARTS = ("mlp on digits", "resumed from")
# Quotes inside a sentence: (page, the quote as the page writes it). Each is part of one printed line;
# "..." stands for text left out. A new one is added here, and to `printed()` if nothing prints it yet.
INLINE = (
    ("docs/install.md", "jdp 0.1.0"),
    ("docs/install.md", "pip install 'jdp-train[plot]'"),
    ("docs/reliability.md", "stopping at step S on SIGTERM; checkpoint saved, rerun the same command to resume."),
    ("docs/reliability.md", "stopping at step S on SIGINT; checkpoint saved, rerun the same command to resume."),
    ("docs/reliability.md", "jdp: interrupted (Ctrl-C); a run's checkpoints already saved are intact."),
    ("docs/reliability.md", "process K stopped abnormally (...): a peer process died, lost its connection, or the "
                            "distributed runtime failed"),
    ("docs/reliability.md", "params of another structure (checkpoint: w (5, 3); this step: w (5, 4)), so it was "
                            "written with another model"),
    ("docs/reliability.md", "checkpoint: 0.count (), 0.mu.w (3,), 0.nu.w (3,); this step: no arrays"),
    ("docs/fsdp.md", "jdp memory: compiling the ZeRO-1 step, 2 of 3 (...)"),
    ("docs/data.md", "item 5 of the source has 'x' of shape (4,) and dtype float32, but item 0's is (3,) float32"),
    ("docs/data.md", "cannot be opened (Permission denied)"),
    ("docs/performance.md", "attention: cudnn (GPU, bfloat16; the config left it auto)"),
    ("docs/performance.md", "remat: off (compiled peak 24.4 GB without it fits 112.6 GB with margin: at most 85%)"),
    ("docs/performance.md", "model FLOPs per step: 40.929 TFLOP (gpt: 6N+12LHQT); MFU against 989.0 TFLOP/s bfloat16 "
                            "per device (NVIDIA H200)"),
    ("docs/data.md", "holds 201 bytes, not a whole number of uint16 tokens"),
    ("docs/data.md", "a uint8 token file cannot hold ids up to vocab_size - 1 = 50303 (at most 255), so the token "
                     "file ... is probably uint16"),
)
# Quotes inside a sentence of `jdp train`'s own output, checked against the real run.
RUN_INLINE = (
    ("README.md", "step 1 compiled and ran in ..."),
    ("docs/training.md", "step 1 compiled and ran in 4.1 s (left out of samples/s)"),
    ("docs/quickstart.md", "0 -> 300 of 300 steps"),
    ("docs/quickstart.md", "4 cpu device(s)"),
    ("docs/quickstart.md", "global batch 128 = 1 accumulation step × 4 devices × 32 examples per device"),
    ("docs/quickstart.md", "reduction mean"),
)
# Output blocks of example scripts (page, first line): tests/test_examples.py runs the script and
# compares its whole output with the block.
EXAMPLE_OUTPUTS = (("docs/fsdp.md", "nnx: equal to one device; gathered per layer"),)
HOME = "/home/you"  # the pages' working directory; a run's own one stands for it
NUMBER = re.compile(r"\d[\d,.]*(?:e[-+]\d+)?")


@dataclass(frozen=True)
class Block:
    """Console lines a page quotes: the lines of one output block (consecutive lines printed one after
    the other, `...` for lines left out), or one quote inside a sentence (`inline`)."""

    page: str
    line: int
    lines: tuple[str, ...]
    inline: bool = False

    @property
    def of_the_run(self) -> bool:
        """The `jdp train` run's own output, which only a real run prints."""
        return (self.page, self.lines[0]) in RUN_INLINE or not self.inline and self.lines[0].startswith(RUN_STARTS)


def pages() -> list[str]:
    """README.md, CONTRIBUTING.md and every Markdown page under docs/ (the build's output excluded)."""
    found = ["README.md", "CONTRIBUTING.md"]
    for where, dirs, files in os.walk(os.path.join(ROOT, "docs")):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("_build", ".")))
        found += sorted(os.path.relpath(os.path.join(where, f), ROOT) for f in files if f.endswith(".md"))
    return found


def read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def blocks(page: str) -> list[Block]:
    """The console output `page` quotes in fences: every line of a ```text, ```console or unlabelled
    block but its `$ ` commands; in a shell block (```bash), the lines after a `$ ` command."""
    found, fence, output = [], None, None  # output: (its first line's number, its lines)
    for number, line in enumerate(read(page).splitlines(), 1):
        if line.lstrip().startswith("```"):
            if output and output[1]:
                found.append(Block(page, output[0], tuple(output[1])))
            if fence is None:  # a fence inside a list item is indented: so are its lines
                fence, indent = line.lstrip()[3:].strip(), len(line) - len(line.lstrip())
            else:
                fence = None
            output = (number + 1, []) if fence in ("text", "console", "") else None
        elif fence in ("text", "console", "", "bash", "sh", "shell") and line[indent:].startswith("$ "):
            if output and output[1]:
                found.append(Block(page, output[0], tuple(output[1])))
            output = (number + 1, [])
        elif output is not None:
            output[1].append(line[indent:])
    return found


def inline(page: str) -> list[Block]:
    """The quotes inside `page`'s sentences that INLINE and RUN_INLINE list, with the line each starts on
    (a quote may wrap); pytest.fail if the page no longer holds one."""
    lines = read(page).splitlines()
    for block in blocks(page):  # a sentence's quote, not the same words in an output block
        lines[block.line - 1:block.line - 1 + len(block.lines)] = [""] * len(block.lines)
    text = "\n".join(lines)
    flat = re.sub(r"\s+", " ", text)
    found = []
    for where, quote in (*INLINE, *RUN_INLINE):
        if where == page:
            if quote not in flat:
                pytest.fail(f"{page} no longer quotes {quote!r}: update INLINE in tests/console_quotes.py")
            first = re.search(r"\s+".join(map(re.escape, quote.split())), text).start()
            found.append(Block(page, text[:first].count("\n") + 1, (quote,), inline=True))
    return found


def quotes() -> list[Block]:
    """Every quote of jdp's console output in the pages, example scripts' output blocks left out (their
    own tests check those); pytest.fail if a listed example block is gone."""
    found = [b for page in pages() for b in (*blocks(page), *inline(page))]
    for page, first in EXAMPLE_OUTPUTS:
        if not any(b.page == page and b.lines[0].startswith(first) for b in found):
            pytest.fail(f"{page} no longer holds the example output starting {first!r}: update EXAMPLE_OUTPUTS")
    return [b for b in found if not any(b.page == page and b.lines[0].startswith(first)
                                        for page, first in EXAMPLE_OUTPUTS)]


def pattern(quote: str, masked: bool = False) -> re.Pattern:
    """`quote` as a regex: "..." matches any text; with `masked`, each number matches any number."""
    def part(text):
        return NUMBER.pattern.join(map(re.escape, NUMBER.split(text))) if masked else re.escape(text)

    return re.compile(".*?".join(part(normal(p)) for p in quote.split("...")))


def normal(text: str) -> str:
    """A printed line as the pages write it: the log file's pid left out (it differs per process)."""
    return re.sub(r"(jdp-process-\d+-)\d+(\.log)", r"\1PID\2", text)


def missing(block: Block, printed: list[str], masked: bool = False) -> list[str]:
    """The lines of `block` that `printed` (lines) does not hold as the block quotes them, [] if none: an
    inline quote inside one line; a block's lines whole and one after the other, the parts between
    `...` lines in that order."""
    printed = [normal(line) for line in printed]
    if block.inline:
        return [] if any(pattern(block.lines[0], masked).search(line) for line in printed) else list(block.lines)
    parts, at = [[]], 0
    for line in block.lines:
        parts.append([]) if line == "..." else parts[-1].append(line)
    for part in filter(None, parts):
        want = [pattern(line, masked) for line in part]
        starts = [i for i in range(at, len(printed) - len(want) + 1)
                  if all(w.fullmatch(printed[i + k]) for k, w in enumerate(want))]
        if not starts:
            return part
        at = starts[0] + len(want)
    return []


def one_by_one(block: Block) -> list[Block]:
    """Each line of `block` as a quote of its own: the lines of an error block come from separate runs."""
    return [Block(block.page, block.line + i, (line,), block.inline) for i, line in enumerate(block.lines)
            if line != "..."]


def printed(tmp_path, monkeypatch, capsys) -> list[str]:
    """The lines jdp prints for every quote but the run's, in `tmp_path` as the working directory
    (written as /home/you, as the pages do)."""
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # jdp train's CLI wraps it
    said = [*_train_errors(monkeypatch, capsys), *_supervisor_lines(),
            *_plot_and_version(tmp_path, monkeypatch, capsys), *_interrupted(capsys), *_messages(tmp_path)]
    return [line.replace(str(tmp_path), HOME) for text in said for line in text.splitlines()]


def _train_errors(monkeypatch, capsys) -> list[str]:
    """What `jdp train --workdir runs/w` prints when training raises each error the pages quote, each
    made by the code that makes it in a run (train's arguments are the real config and workdir)."""
    import logging

    import jax

    import jdp.run.cli
    import jdp.run.train
    from jdp.config import load_config
    from jdp.data import load_tokens
    from jdp.run.checkpoint import CheckpointWriteError, Checkpointer
    from jdp.run.checkpoint_faults import out_of_space as writing_out_of_space
    from jdp.run.distributed import disagreement
    from jdp.run.facts import RunFacts
    from jdp.run.lock import locked_workdir
    from jdp.run.records import evaluation_out_of_memory, unreadable_batch
    from jdp.run.tasks import token_files

    def out_of_space(config, workdir):
        checkpoints = Checkpointer(os.path.join(workdir, "checkpoints"))  # as train() makes it
        try:
            with writing_out_of_space(checkpoints.directory, (2, 115_000)):  # the default MLP's params and Adam's moments
                raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        except CheckpointWriteError as e:
            return e
        finally:
            checkpoints.close()

    def evaluation_out_of_memory_after_4(config, workdir):
        xla = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.")
        return evaluation_out_of_memory(4, xla, config.data.eval_batch_size)

    def token_file_rewritten(config, workdir):
        os.makedirs("data")
        np.zeros(400_000, np.uint16).tofile("data/train.bin")  # 800000 bytes
        tokens = load_tokens("data/train.bin", context_length=64)
        os.truncate("data/train.bin", 20_000)
        try:
            tokens[0]
        except ValueError as e:
            return unreadable_batch(18, e, saved=17)

    def lock_is_a_symlink(config, workdir):
        os.makedirs(workdir, exist_ok=True)
        os.symlink(f"{HOME}/notes.txt", os.path.join(workdir, ".jdp-lock"))
        with locked_workdir(workdir):
            pass

    def processes_disagree(*overrides, local=(2, 2)):
        """Two processes' facts as each computes them: from its config, and every device of the job (its
        `local` ones among them)."""
        mine, theirs = jax.devices()[:8], SimpleNamespace(process_index=1)
        return lambda config, workdir: ValueError(disagreement([
            RunFacts.of(load_config(None, list(o)), [*mine[:n], *[theirs] * (sum(local) - n)]).agreed
            for o, n in zip(overrides, local)]))

    def data_differs(config, workdir):
        facts = []
        for host in range(2):  # each host's own train.bin: the same size, other tokens
            os.makedirs(f"host{host}")
            os.chdir(f"host{host}")
            np.random.default_rng(host).integers(0, 64, 5000).astype(np.uint16).tofile("train.bin")
            config = load_config(None, ["model.name=gpt", "data.name=tokens", "data.vocab_size=64",
                                        "model.context=8", "data.path=train.bin"])
            paths = (config.data.path, config.data.val_path)  # as train() reads them
            facts.append(RunFacts.of(config).with_data(*token_files(config), paths=paths).data_facts())
            os.chdir("..")
        return ValueError(disagreement(facts))

    causes = [out_of_space, evaluation_out_of_memory_after_4, token_file_rewritten, lock_is_a_symlink,
              processes_disagree(["train.checkpoint_every=2"], ["train.checkpoint_every=3"], local=(2, 4)),
              processes_disagree(["optim.lr=0.003", "train.seed=0"], ["optim.lr=0.001", "train.seed=1"]),
              data_differs]
    asyncio_log = logging.getLogger("asyncio")
    monkeypatch.setattr(asyncio_log, "filters", list(asyncio_log.filters))  # the CLI quiets a failed save's tasks
    said = []
    for cause in causes:
        def train(config, workdir, **options):
            raise cause(config, workdir) or AssertionError(f"{cause.__name__} raised nothing")

        monkeypatch.setattr(jdp.run.train, "train", train)
        code = jdp.run.cli.main(["train", "--workdir", "runs/w", "--no-progress"])
        said.append(capsys.readouterr().err)
        assert code in (1, 2) and said[-1].startswith("jdp: error: "), (cause.__name__, said[-1])
    return said


# The lines of jax's coordination service that the supervisor reads (from real runs: a peer killed, a
# --process-id given twice, a process that never joined).
NO_HEARTBEAT = ("E1202 10:57:43.868768   13189 coordination_service.cc:1549] Use error polling to propagate the "
                "following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending "
                "heartbeats):\n1\nThe tasks have crashed.\n")
DUPLICATE = ("F1201 21:45:40.252760   13669 client.h:80] Terminating process because the JAX distributed service "
             "detected fatal errors. absl::Status: ALREADY_EXISTS: Aborted connect attempt as there is a request "
             "from a newer incarnation.\n")
NOT_JOINED = ("absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded\n\n"
              "RPC: /xla.coordination.CoordinationService/RegisterTask\n")
ABORT = ["F1202 10:57:43.868999   13189 client.h:80] Terminating process\n"]  # what the supervisor hides and keeps


def _supervisor_lines() -> list[str]:
    """What the supervisor of a multi-process `jdp train --workdir runs/mp` prints when jax aborts its
    process (SIGABRT), as `supervise` makes the line: the sentence, and the log it kept."""
    from jdp.run.supervisor import _keep_log, abnormal_end, error_line

    def line(process, tail, processes, init_timeout=60):
        why = abnormal_end(process, -6, tail, 10, num_processes=processes, init_timeout=init_timeout)
        return error_line(why, _keep_log("runs/mp", process, ABORT))

    return [line(0, NO_HEARTBEAT, 2), line(1, DUPLICATE, 3), line(0, NOT_JOINED, 3, init_timeout=10),
            abnormal_end("K", -6, "", 10)]


def _plot_and_version(tmp_path, monkeypatch, capsys) -> list[str]:
    """`jdp plot` without matplotlib, in the checkout and installed from a wheel; `jdp --version`."""
    import sys

    import jdp.extras
    import jdp.run.cli

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    said = []
    monkeypatch.chdir(ROOT)
    for checkout in (jdp.extras.checkout, lambda: None):
        monkeypatch.setattr(jdp.extras, "checkout", checkout)
        assert jdp.run.cli.main(["plot", str(tmp_path / "run")]) == 2
        said.append(capsys.readouterr().err)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        jdp.run.cli.main(["--version"])
    return [*said, capsys.readouterr().out]


def _interrupted(capsys) -> list[str]:
    """What the `jdp` command prints on a Ctrl-C outside training (`run_quietly`'s line, the one its
    SIGINT handler writes), here from a KeyboardInterrupt raised inside the command."""
    from jdp.run.exits import INTERRUPTED, run_quietly

    def command():
        raise KeyboardInterrupt

    assert run_quietly(command) == INTERRUPTED
    return [capsys.readouterr().err]


def _messages(tmp_path) -> list[str]:
    """The sentences the pages quote from the API and the trainer's log: a stop on SIGTERM or SIGINT,
    `jdp memory`'s progress, another model's or optimizer's checkpoint restored, bad token files and
    items."""
    import jax
    import optax

    import jdp
    from jdp.data import load_tokens, make_batches
    from jdp.run.records import stopping_line

    from jdp.run.memory_table import progress_line

    from jdp.inspect.flops import GPT_SOURCE, ModelFlops
    from jdp.run.device_defaults import choose_attention, choose_remat
    from jdp.run.metrics import flops_line

    said = [stopping_line("S", "SIGTERM"), stopping_line("S", "SIGINT"),
            progress_line(63.1, layout="ZeRO-1", number=2, total=3),
            choose_attention("auto", "gpu", "bfloat16")[1], choose_remat("auto", 24_400_000_000, 112_583_507_968)[1],
            flops_line(ModelFlops(40_929_293_500_416, GPT_SOURCE), 989e12, "NVIDIA H200", "bfloat16")]

    def loss(params, batch):
        return ((batch["x"] @ params["w"]) ** 2).mean()

    for name, (saved, shape, restored, into) in {"model": (optax.adam, (5, 3), optax.adam, (5, 4)),
                                                 "optimizer": (optax.adam, (3,), optax.sgd, (3,))}.items():
        steps = [jdp.make_train_step(loss, make(0.1), devices=jax.devices()[:1]) for make in (saved, restored)]
        jdp.save_state(str(tmp_path / name), steps[0], steps[0].init({"w": np.zeros(shape, np.float32)}))
        with pytest.raises(jdp.run.checkpoint.CheckpointMismatchError) as error:
            jdp.restore_state(str(tmp_path / name), steps[1], steps[1].init({"w": np.zeros(into, np.float32)}))
        said.append(str(error.value))

    def refused(make, *args, **kwargs):
        with pytest.raises(ValueError) as error:
            make(*args, **kwargs)
        return str(error.value)

    items = [{"x": np.zeros(4 if i == 5 else 3, np.float32)} for i in range(8)]
    said.append(refused(make_batches, items, 4))
    (tmp_path / "odd.bin").write_bytes(bytes(201))
    said.append(refused(load_tokens, tmp_path / "odd.bin", context_length=8))
    said.append(refused(load_tokens, "train.bin", context_length=8, dtype="uint8", vocab_size=50304))

    def no_permission(path, *args):  # as root, a file without read permission is read anyway
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "open", no_permission)
        said.append(refused(load_tokens, tmp_path / "odd.bin", context_length=8))
    return said
