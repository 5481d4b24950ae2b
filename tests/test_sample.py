"""`jdp sample WORKDIR` end to end: a tiny GPT trained through the CLI in every layout (replicated, ZeRO-1,
FSDP scanned and not) reads back from its checkpoint and continues text greedily exactly as the whole
forward pass per token does; refusals in one sentence; a damaged newest checkpoint skipped, left as it
is. And the trainer's held-out units: perplexity and bits per byte. Runs call `jdp.run.cli.main` here."""
import json
import math
import contextlib
import io
import os
import shutil
import subprocess

import jax
import numpy as np
import pytest
import tensorstore as ts
from flax import nnx

from jdp.models.decode import greedy_reference
from helpers import cli
from jdp.run.checkpoint import latest_params
from jdp.run.cli import main
from jdp.run.metrics import curves_figure, load_metrics
from jdp.run.records import language_model_units
from jdp.run.sampling import load_run

# The tokens run: byte tokens below 64 (a bytes tokenizer's ids), a GPT of 2 layers, 2 SGD steps on 2 devices.
TINY = ["model.name=gpt", "data.name=tokens", "data.vocab_size=64", "model.d_model=16", "model.n_heads=2",
        "model.n_layers=2", "model.context=8", "model.dropout=0.0", "data.batch_size=16", "optim.name=sgd",
        "optim.lr=0.3"]
LAYOUTS = {"replicated": [], "zero1": ["parallel.shard_optimizer_state=true"],
           "fsdp_scanned": ["parallel.shard_params=true"],  # jdp train scans the GPT under FSDP by default
           "fsdp_unscanned": ["parallel.shard_params=true", "model.scan_layers=false"]}
PROMPTS = ["01", "?5:"]
VAL_BYTES_PER_TOKEN = 2.0  # what the folder's meta.json says of val.bin (a made-up ratio: the test's to check)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    rng.integers(0, 64, 3000).astype(np.uint16).tofile(d / "train.bin")
    rng.integers(0, 64, 401).astype(np.uint16).tofile(d / "val.bin")
    meta = {"vocab_size": 64, "dtype": "uint16", "tokenizer": {"kind": "bytes", "file": None},
            "splits": {"train": {"tokens": 3000, "bytes": 3000}, "val": {"tokens": 401, "bytes": 802}}, "inputs": []}
    (d / "meta.json").write_text(json.dumps(meta))
    return d


def train(capsys, workdir, files, *overrides):
    sets = [x for o in (*TINY, f"data.path={files / 'train.bin'}", f"data.val_path={files / 'val.bin'}", *overrides)
            for x in ("--set", o)]
    r = cli(capsys, "train", "--workdir", workdir, "--devices", "2", "--steps", 2, "--no-progress", *sets)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_samples_greedily_as_the_whole_forward_pass_does(layout, files, tmp_path, capsys):
    work = tmp_path / layout
    train(capsys, work, files, *LAYOUTS[layout])
    r = cli(capsys, "sample", work, *(x for p in PROMPTS for x in ("--prompt", p)), "--temperature", "0",
            "--tokens", "6")
    assert r.returncode == 0, r.stderr
    assert f"2 × 6 tokens from checkpoint 2 of {work} in " in r.stderr and " tokens/s (compiled in " in r.stderr
    run = load_run(str(work))
    assert run.model.scan_layers == (layout == "fsdp_scanned") and run.step == 2
    for saved, read in zip(jax.tree.leaves(latest_params(str(work))[1]), jax.tree.leaves(nnx.state(run.model,
                                                                                                 nnx.Param))):
        np.testing.assert_array_equal(saved, np.asarray(read))  # the trained params, whatever the layout
    reference = greedy_reference(run.model, [run.tokenizer.encode(p) for p in PROMPTS], 6)
    texts = [p + run.tokenizer.decode(row) for p, row in zip(PROMPTS, reference)]
    assert r.stdout == texts[0] + "\n\n" + "-" * 40 + "\n" + texts[1] + "\n"


@pytest.fixture(scope="module")
def trained(files, tmp_path_factory):
    """A tokens run of 2 steps with checkpoints 1 and 2, and what `jdp train` printed."""
    work = tmp_path_factory.mktemp("trained") / "w"
    sets = [x for o in (*TINY, f"data.path={files / 'train.bin'}", f"data.val_path={files / 'val.bin'}")
            for x in ("--set", o)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["train", "--workdir", str(work), "--devices", "2", "--steps", "2", "--checkpoint-every", "1",
                     "--no-progress", *sets])
    assert code == 0, out.getvalue()
    return work, out.getvalue()


def test_evaluation_reports_the_per_token_loss_perplexity_and_bits_per_byte(trained):
    work, out = trained
    evals = [r for r in load_metrics(str(work)) if "eval_loss" in r][-1]
    assert evals["eval_perplexity"] == pytest.approx(math.exp(evals["eval_loss"]), rel=1e-12)
    # bits per byte from meta.json's val split: 802 bytes of text in 401 tokens
    assert evals["eval_bits_per_byte"] == pytest.approx(evals["eval_loss"] / math.log(2) / VAL_BYTES_PER_TOKEN,
                                                        rel=1e-12)
    line = (f"eval accuracy {evals['eval_accuracy']:.4f}  loss/token {evals['eval_loss']:.4f}  perplexity "
            f"{evals['eval_perplexity']:.4f}  bits_per_byte {evals['eval_bits_per_byte']:.4f}")
    assert f"step      2  {line}" in out and f"held-out {line.removeprefix('eval ')}; workdir" in out


def test_sampling_is_seeded_a_damaged_checkpoint_is_skipped_and_bad_prompts_refused(trained, tmp_path, capsys):
    work = tmp_path / "w"
    shutil.copytree(trained[0], work)
    sample = lambda *a: cli(capsys, "sample", work, "--prompt", "01", "--tokens", "5", *a)  # noqa: E731
    first, again, other = sample("--seed", "3"), sample("--seed", "3"), sample("--seed", "4")
    assert first.returncode == 0 and first.stdout == again.stdout != other.stdout
    # Damaged newest checkpoint: said, skipped for the one before it, and left where it is.
    before = sorted(os.listdir(work / "checkpoints"))
    _flip_a_bit(work / "checkpoints" / "2" / "state")
    r = sample("--temperature", "0")
    assert r.returncode == 0 and f"checkpoint 2 in '{work}/checkpoints' is damaged: its saved arrays do not match " \
           "the sha256 recorded when it was saved; trying the one before it" in r.stderr
    assert "from checkpoint 1 of" in r.stderr and sorted(os.listdir(work / "checkpoints")) == before
    for args, message in [(["--prompt", "A"], "prompt 0 holds the token id 65; the model's vocabulary is 0..63."),
                          (["--prompt", "0123456789"], "a prompt of 10 tokens is longer than the model's context of 8; "
                                                       "shorten it."),
                          (["--prompt", "0123", "--tokens", "6"], "a prompt of 4 tokens and 6 new tokens need 9 "
                                                                  "positions, more than the model's context of 8")]:
        r = cli(capsys, "sample", work, *args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_checkpoint_removed_while_it_is_read_is_not_damaged_the_newest_one_there_now_is_read(
        trained, tmp_path, capsys, monkeypatch):
    """As a running jdp train does: checkpoint 3 saved and 2 rotated away after jdp sample listed [2, 1] and
    before it read 2. It reads 3 (the newest that exists), says so in one line, and calls nothing damaged."""
    from jdp.run.checkpoint import Checkpointer
    from jdp.run.workfiles import remove_checkpoint

    work = tmp_path / "w"
    shutil.copytree(trained[0], work)
    checkpoints, run_info = work / "checkpoints", Checkpointer.run_info

    def rotated_first(self, number):
        if number == 2 and (checkpoints / "2").exists():
            shutil.copytree(checkpoints / "2", checkpoints / "3")  # the trainer's next save...
            assert remove_checkpoint(str(checkpoints), "2")  # ...and its rotation, as jdp train does it
        return run_info(self, number)

    monkeypatch.setattr(Checkpointer, "run_info", rotated_first)
    r = cli(capsys, "sample", work, "--prompt", "01", "--tokens", "3", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[0] == (f"checkpoint 2 in '{checkpoints}' was removed while it was being read (a "
                                        f"running jdp train rotates its checkpoints), so it is not damaged; reading "
                                        f"the newest one there now")
    assert len(r.stderr.splitlines()) == 2 and "from checkpoint 3 of" in r.stderr and "is damaged" not in r.stderr and "unreadable" not in r.stderr


@pytest.mark.parametrize("cut", [("state/manifest.ocdbt", 0.5), ("meta/metadata", 0.0), ("_CHECKPOINT_METADATA", 0.5),
                                 ("state/d", 0.5)], ids=["manifest_half", "meta_empty", "step_metadata_half", "data_half"])
def test_a_truncated_checkpoint_is_said_in_one_line_whatever_is_cut(cut, trained, tmp_path, capsys, caplog):
    """Checkpoint 2 with one file cut short: one line on stderr about it (orbax's log records, which absl
    prints, and tensorstore's "Event loop is closed" tracebacks, which pytest turns into errors, do not
    spill), then the speed line."""
    work = tmp_path / "w"
    shutil.copytree(trained[0], work)
    name, fraction = cut
    path = work / "checkpoints" / "2" / name
    path = max(path.iterdir(), key=lambda f: f.stat().st_size) if path.is_dir() else path  # a data file: the largest
    os.truncate(path, int(path.stat().st_size * fraction))
    r = cli(capsys, "sample", work, "--prompt", "01", "--tokens", "3", "--temperature", "0")
    lines = r.stderr.splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stderr
    assert lines[0].startswith(f"checkpoint 2 in '{work}/checkpoints'") and "Traceback" not in r.stderr
    assert lines[1].startswith("1 × 3 tokens from checkpoint ")
    assert not [record.getMessage() for record in caplog.records if record.name == "absl"]


def _flip_a_bit(state_dir):
    """Flip one bit of the saved head kernel: it reads back without error but holds another value."""
    spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{state_dir}/"},
            "path": "params.head.kernel.value"}
    array = ts.open(spec).result()
    values = array.read().result()
    values.view(np.uint32)[0, 0] ^= 1 << 30
    array.write(values).result()


@pytest.mark.parametrize("args,message", [
    (["/nonexistent/run"], "'/nonexistent/run' holds no checkpoint ('/nonexistent/run/checkpoints' does not exist); "
                           "train a GPT there first"),
    (["w", "--top-p", "1.5"], "argument --top-p: 1.5 must be in (0, 1]"),
    (["w", "--top-p", "0"], "argument --top-p: 0 must be in (0, 1]"),
    (["w", "--temperature", "-1"], "argument --temperature: -1 must be 0 (greedy) or positive"),
    (["w", "--tokens", "0"], "argument --tokens: 0 must be at least 1"),
    (["w", "--top-k", "0"], "argument --top-k: 0 must be at least 1"),
    (["w", "--prompt", ""], "prompt 1 is empty"),
    (["w", "--prompts-file", "/nonexistent/prompts.txt"], "--prompts-file '/nonexistent/prompts.txt' cannot be read "
                                                          "as UTF-8 text (No such file or directory)."),
])
def test_bad_sample_arguments_exit_2_in_one_sentence(args, message, tmp_path, capsys):
    os.makedirs(tmp_path / "w" / "checkpoints")  # a workdir with no checkpoint in it yet
    args = [str(tmp_path / a) if a == "w" else a for a in args]
    try:
        r = cli(capsys, "sample", *args)
    except SystemExit as e:  # argparse's refusal: its usage line and one sentence, exit code 2
        out, err = capsys.readouterr()
        r = subprocess.CompletedProcess(args, e.code, out, err)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert os.listdir(tmp_path / "w" / "checkpoints") == []


def test_an_empty_checkpoint_folder_is_refused_in_one_sentence(tmp_path, capsys):
    os.makedirs(tmp_path / "w" / "checkpoints")
    r = cli(capsys, "sample", tmp_path / "w")
    assert r.returncode == 2 and "no complete checkpoint in" in r.stderr and "train the run first" in r.stderr


def test_language_model_units_are_exp_and_log2_of_the_per_token_loss():
    units = language_model_units({"loss": 1.5, "accuracy": 0.5}, 1.25)
    assert units == {"loss": 1.5, "accuracy": 0.5, "perplexity": math.exp(1.5), "bits_per_byte": 1.5 / math.log(2) / 1.25}
    assert "bits_per_byte" not in language_model_units({"loss": 1.5}, None)  # bytes per token unknown: not guessed
    assert language_model_units({"loss": 800.0}, None)["perplexity"] == math.inf


def test_plot_labels_the_loss_per_token_for_a_language_model_and_per_example_otherwise():
    import matplotlib.pyplot as plt

    for records, unit in [([{"step": 1, "loss": 2.0, "weight": 64.0}], "token"),
                          ([{"step": 1, "eval_loss": 2.0, "eval_perplexity": 7.4}], "token"),
                          ([{"step": 1, "loss": 2.0}, {"step": 1, "eval_loss": 2.0}], "example")]:
        fig = curves_figure(records, "run")
        try:
            assert fig.axes[0].get_ylabel() == f"loss (mean per {unit})"
        finally:
            plt.close(fig)


def test_bytes_per_token_of_the_char_corpus_and_of_token_folders(tmp_path):
    from jdp.data import load_char_corpus
    from jdp.run.tasks import char_bytes_per_token, token_bytes_per_token

    corpus = load_char_corpus()
    held_out = corpus.decode(corpus.val)
    assert char_bytes_per_token(corpus) == len(held_out.encode("utf-8")) / len(corpus.val) > 1.0  # non-ASCII characters
    (tmp_path / "val.bin").write_bytes(b"")
    assert token_bytes_per_token(str(tmp_path / "val.bin"), 256) == 1.0  # no meta.json, 256 ids: byte tokens
    assert token_bytes_per_token(str(tmp_path / "val.bin"), 50304) is None  # another tokenizer's ids: unknown
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50304, "dtype": "uint16", "tokenizer": {"kind": "file", "file": "tokenizer.json"},
                                                    "splits": {"val": {"tokens": 400, "bytes": 1700}}}))
    assert token_bytes_per_token(str(tmp_path / "val.bin"), 50304) == 4.25
