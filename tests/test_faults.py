"""A catalog of faults and bad inputs for `jdp train` (and `jdp plot`), run as a user runs them.

Every case runs the CLI in a fresh process and checks the contract of docs/training.md: exit
code 2, exactly one line `jdp: error: <one sentence>` naming the bad value and what is allowed,
no traceback, and nothing written or changed: every file and directory of the case's directory
(its config, its arrays, its workdir and the checkpoint in it) has the same path, size and
sha256 afterwards, and nothing new appears (a run that never starts leaves no workdir behind).

Each case is a row of a table: (id, its inputs, arguments, the expected message). The cases that
resume copy one template run, trained once per module. The processes of the selected cases run
a few at a time in a thread pool started by the `runs` fixture (each takes 1-3 s, mostly
imports); each test waits for its own.
"""
import hashlib
import os
import pickle
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from benchmarks.common import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One xdist worker runs this file: the `runs` fixture starts every selected case's process at once.
pytestmark = pytest.mark.xdist_group("test_faults")
# The template run, and every run that resumes from a copy of it.
TEMPLATE_ARGS = ["--steps", "2", "--devices", "2", "--set", "data.batch_size=64"]
WORKERS = max(2, min(4, os.cpu_count() or 2))


def run_jdp(*args, timeout=120):
    """`python -W error -m jdp.run.cli ARGS` from the repo root in a fresh process with its own fake devices."""
    # conftest's 8-device XLA_FLAGS (and a thread-pool size chosen for it) must not reach the CLI,
    # which sets up its own devices (as tests/test_examples.py does).
    env = child_env()
    return subprocess.run([sys.executable, "-W", "error", "-m", "jdp.run.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def assert_refused(r, *expected):
    """Exit code 2, one `jdp: error:` line holding every `expected` piece, no traceback."""
    shown = f"rc {r.returncode}\nstdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-4000:]}"
    assert r.returncode == 2, shown
    assert "Traceback" not in r.stderr, shown
    errors = [line for line in r.stderr.splitlines() if line.startswith("jdp: error: ")]
    assert len(errors) == 1, shown
    for piece in expected:
        assert piece in errors[0], f"{piece!r} not in:\n{errors[0]}"
    assert errors[0].endswith("."), errors[0]  # one whole sentence


def snapshot(directory) -> dict:
    """Every directory and file under `directory`: {relative path: None (a directory) or (size, sha256)}."""
    out = {}
    for d, dirs, files in os.walk(directory):
        for name in dirs:
            out[os.path.relpath(os.path.join(d, name), directory)] = None
        for name in files:
            path = os.path.join(d, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = (os.path.getsize(path), hashlib.sha256(f.read()).hexdigest())
    return out


@dataclass(frozen=True)
class Case:
    """One fault: `setup(dir)` writes its inputs into its own directory, then `jdp *argv` must be refused.

    "{dir}" in `argv` and in `expected` (the pieces of the error line) stands for that directory.
    `template`: copy the template run to {dir}/w first.
    """

    id: str
    argv: list
    expected: list
    setup: Callable | None = None
    template: bool = False


# Config: keys, types, ranges and combinations, refused before any device is set up.
# (id, YAML text of the CONFIG file {dir}/c.yaml or None, arguments, the whole message after "jdp: error: ")
OPTIM_KEYS = ("name, lr, momentum, b1, b2, eps, weight_decay, clip_norm, schedule, warmup_steps, linear_scaling, "
              "base_batch_size")
CONFIG_CASES = [
    # Broken or missing keys and files.
    ("unknown-section", "modle:\n  name: mlp\n", [],
     "unknown key 'modle'; a config has: model, data, optim, parallel, train."),
    ("unknown-field", "optim:\n  learning_rate: 0.1\n", [],
     f"unknown key 'optim.learning_rate'; optim has: {OPTIM_KEYS}."),
    ("yaml-is-a-list", "- model\n- optim\n", [],
     "{dir}/c.yaml must hold a mapping of sections (model, data, optim, parallel, train), got list."),
    ("section-is-a-number", "optim: 0.1\n", [],
     f"optim must be a mapping of its keys ({OPTIM_KEYS}), got float."),
    ("yaml-syntax-error", "optim:\n  lr: 0.1\n  name: [adam\ntrain:\n  steps: 3\n", [],
     "{dir}/c.yaml: invalid YAML at line 4, column 6: expected ',' or ']', but got ':'."),
    # An empty file is an empty mapping: every default (data.batch_size=128), which 3 devices cannot split.
    ("empty-yaml-means-defaults", "", ["--devices", "3"],
     "data.batch_size=128 is not a multiple of parallel.accum_steps × devices = 1 × 3; use a multiple of 3."),
    ("missing-config-file", None, ["{dir}/nope.yaml"],
     "config '{dir}/nope.yaml' is neither a file nor a shipped config; the shipped ones are char_gpt, char_gpt_bf16, "
     "char_gpt_tokens, digits_cnn_syncbn, digits_mlp, digits_mlp_accum_psum, digits_mlp_bf16, gpt2_small, seed_linear, "
     "stdlib_bpe_gpt (jdp configs lists them)."),
    ("config-is-a-directory", None, ["{dir}"], "config '{dir}' is a directory, and a directory is never a config; "
     "give a YAML file or the name of a shipped config: char_gpt, "),
    ("set-without-equals", None, ["--set", "optim.lr"],
     "override 'optim.lr' has no '='; write section.key=value, e.g. optim.lr=3e-4."),
    ("set-without-section", None, ["--set", "lr=0.1"],
     "override 'lr=0.1' must name one key as section.key, e.g. optim.lr=3e-4."),
    ("set-without-value", None, ["--set", "optim.lr="],
     "override 'optim.lr=' has no value; write optim.lr=null for none."),
    ("set-unknown-key", None, ["--set", "model.layers=3"],
     "unknown key 'model.layers'; model has: name, hidden, channels, sync_batchnorm, d_model, n_heads, n_layers, "
     "dropout, context, attention, remat, scan_layers, loss_chunk, init_from."),
    ("set-invalid-yaml", None, ["--set", "model.hidden=[64"],
     "override 'model.hidden=[64' has a value that is not valid YAML: '[64'."),
    # Wrong types.
    ("string-for-int", None, ["--set", "train.steps=ten"], "train.steps must be a positive integer, got 'ten'."),
    ("float-for-int", None, ["--set", "data.batch_size=64.5"],
     "data.batch_size must be a positive integer, got 64.5."),
    ("bool-for-int", None, ["--set", "parallel.accum_steps=true"],
     "parallel.accum_steps must be a positive integer, got true."),
    ("list-for-float", None, ["--set", "optim.lr=[0.1]"], "optim.lr must be a positive number, got [0.1]."),
    ("nan-for-float", "optim:\n  lr: .nan\n", [], "optim.lr must be a positive number, got nan."),
    ("string-for-bool", None, ["--set", "data.drop_last=maybe"], "data.drop_last must be true or false, got 'maybe'."),
    ("int-for-hidden", None, ["--set", "model.hidden=128"], "model.hidden must be a list of positive integers, got 128."),
    ("zero-width-in-hidden", None, ["--set", "model.hidden=[64,0]"],
     "model.hidden must be a list of positive integers, got [64, 0]."),
    # Zero or negative where a positive value is required.
    ("zero-lr", None, ["--set", "optim.lr=0"], "optim.lr must be a positive number, got 0."),
    ("negative-lr-in-yaml", "optim:\n  lr: -0.001\n", [], "optim.lr must be a positive number, got -0.001."),
    ("zero-steps", None, ["--set", "train.steps=0"], "train.steps must be a positive integer, got 0."),
    ("negative-batch-size", None, ["--set", "data.batch_size=-64"],
     "data.batch_size must be a positive integer, got -64."),
    ("zero-accum-steps", None, ["--set", "parallel.accum_steps=0"],
     "parallel.accum_steps must be a positive integer, got 0."),
    # A choice field with a value outside its choices.
    ("bad-model-name", None, ["--set", "model.name=resnet"],
     "model.name must be one of mlp, cnn, gpt, linear, got 'resnet'."),
    ("bad-data-name", None, ["--set", "data.name=mnist"],
     "data.name must be one of digits, chars, seed_linear, arrays, tokens, got 'mnist'."),
    ("bad-optim-name", None, ["--set", "optim.name=lamb"],
     "optim.name must be one of sgd, momentum, adam, adamw, got 'lamb'."),
    ("bad-schedule", None, ["--set", "optim.schedule=step"],
     "optim.schedule must be one of constant, cosine, linear, got 'step'."),
    ("bad-backend", "parallel:\n  backend: pjit\n", [],
     "parallel.backend must be one of shard_map, pmap, jit, got 'pjit'."),
    ("bad-reduction", None, ["--set", "parallel.reduction=max"],
     "parallel.reduction must be one of mean, sum, got 'max'."),
    ("bad-accum-sync", None, ["--set", "parallel.accum_sync=never"],
     "parallel.accum_sync must be one of every, last, got 'never'."),
    ("bad-lr-correction", None, ["--set", "parallel.reduction=sum", "--set", "parallel.lr_correction=half"],
     "parallel.lr_correction must be null or one of auto, none, exact, got 'half'."),
    ("data-path-not-npz", None, ["--set", "data.name=arrays", "--set", "data.path=data.csv"],
     "data.path must be the path of a .npz file with data.name='arrays', got 'data.csv'."),
    # Impossible combinations.
    ("batch-not-divisible", None, ["--devices", "4", "--set", "data.batch_size=80", "--set", "parallel.accum_steps=8"],
     "data.batch_size=80 is not a multiple of parallel.accum_steps × devices = 8 × 4; use a multiple of 32."),
    ("more-devices-than-batch", None, ["--devices", "16", "--set", "data.batch_size=8"],
     "data.batch_size=8 is not a multiple of parallel.accum_steps × devices = 1 × 16; use a multiple of 16."),
    ("batch-larger-than-digits", None, ["--set", "data.batch_size=2048"],
     "data.batch_size=2048 is more than the 1438 digits training examples, so with data.drop_last=true no batch "
     "is ever full."),
    ("lr-correction-with-mean", None, ["--set", "parallel.lr_correction=auto"],
     "parallel.lr_correction: lr_correction='auto' only applies to reduction='sum'; the mean reduction already "
     "yields the global-batch gradient (use None or 'none')."),
    ("gpt-on-digits", None, ["--set", "model.name=gpt"],
     "model.name='gpt' cannot train on data.name='digits'; gpt takes data.name chars or tokens."),
    ("cnn-on-chars", "model:\n  name: cnn\ndata:\n  name: chars\n", [],
     "model.name='cnn' cannot train on data.name='chars'; cnn takes data.name digits or arrays."),
    ("arrays-without-path", None, ["--set", "data.name=arrays"],
     "data.name='arrays' needs data.path, a .npz file with arrays 'x' and 'y'."),
    ("arrays-path-missing", None, ["--set", "data.name=arrays", "--set", "data.path={dir}/missing.npz"],
     f"data.path='{{dir}}/missing.npz' is not a file (relative paths start at {ROOT})."),
    ("weight-decay-with-adam", None, ["--set", "optim.weight_decay=0.01"],
     "optim.weight_decay: weight_decay=0.01 needs name='adamw' (decoupled decay); got name='adam'."),
    ("warmup-not-before-decay-end", None, ["--steps", "100", "--set", "optim.schedule=cosine",
                                           "--set", "optim.warmup_steps=100"],
     "optim.warmup_steps: warmup_steps=100 must be less than decay_steps=100, since schedule='cosine' decays to 0 "
     "at decay_steps."),
    ("sync-batchnorm-without-cnn", None, ["--set", "model.sync_batchnorm=true"],
     "model.sync_batchnorm=true needs model.name='cnn' (the model with BatchNorm), got 'mlp'."),
    ("gpt-heads-do-not-divide-width", "model:\n  name: gpt\n  d_model: 66\ndata:\n  name: chars\n", [],
     "model.d_model=66 is not divisible by model.n_heads=4."),
]


def _write_config(text):
    return lambda d: (d / "c.yaml").write_text(text)


def config_case(id, text, args, message) -> Case:
    config = [] if text is None else ["{dir}/c.yaml"]
    return Case(id, ["train", *config, *args, "--workdir", "{dir}/w", "--no-progress"], ["jdp: error: " + message],
                None if text is None else _write_config(text))


# Data: a user's .npz (data.name=arrays, {dir}/d.npz), refused when it is loaded, before the workdir exists.
# (id, what d.npz holds: a dict of arrays or raw bytes, extra arguments, the message after "jdp: error: ")
X = np.random.default_rng(0).normal(size=(40, 5)).astype(np.float32)
Y = np.arange(40) % 3


def _x_with(**where):
    x = X.copy()
    for value, rows in where.items():
        x[rows, 1] = {"nan": np.nan, "inf": np.inf}[value]
    return x


NPZ = "data.path '{dir}/d.npz':"
DATA_CASES = [
    ("nan-and-inf-in-x", {"x": _x_with(nan=[3, 9], inf=[5]), "y": Y}, [],
     f"{NPZ} array 'x' has 3 non-finite values (NaN or ±inf); remove or replace them: every loss and gradient "
     f"they touch would be NaN."),
    ("nan-in-linear-targets", {"x": X, "y": np.where(Y == 1, np.nan, 0.5)}, ["--set", "model.name=linear"],
     f"{NPZ} array 'y' has 13 non-finite values (NaN or ±inf); remove or replace them: every loss and gradient "
     f"they touch would be NaN."),
    ("y-2d", {"x": X, "y": np.stack([Y, Y], 1)}, [],
     f"{NPZ} array 'y' has shape (40, 2); it must hold one class label per example, shape (n,)."),
    ("x-1d", {"x": X[:, 0], "y": Y}, [],
     f"{NPZ} array 'x' has shape (40,); the mlp takes one row of features per example, shape (n, features...); "
     f"use x[:, None] for a single feature."),
    ("x-not-images-for-cnn", {"x": X, "y": Y}, ["--set", "model.name=cnn"],
     f"{NPZ} array 'x' has shape (40, 5); the cnn takes 8×8 images of shape (n, 8, 8, 1) or (n, 64)."),
    ("float-labels", {"x": X, "y": Y + 0.5}, [],
     f"{NPZ} array 'y' has dtype float64; the mlp needs integer class labels 0, 1, 2, ..."),
    ("negative-labels", {"x": X, "y": Y - 1}, [],
     f"{NPZ} array 'y' has the negative label -1; the mlp needs integer class labels 0, 1, 2, ..."),
    ("string-x", {"x": np.array(["a"] * 40), "y": Y}, [],
     f"{NPZ} array 'x' has dtype <U1; it must hold numbers (bool, int or float)."),
    ("pickled-object-array", {"x": np.array([{"a": 1}] * 40, dtype=object), "y": Y}, [],
     "'{dir}/d.npz' holds an object array 'x', which numpy stores as a pickle and allow_pickle=False refuses to "
     "load; save numeric arrays instead."),
    ("pickle-file-named-npz", pickle.dumps({"x": X, "y": Y}), [],
     "'{dir}/d.npz' is not a valid .npz file (it is not a zip archive, which numpy.savez writes)."),
    ("random-bytes", np.random.default_rng(1).bytes(1000), [],
     "'{dir}/d.npz' is not a valid .npz file (it is not a zip archive, which numpy.savez writes)."),
    ("mismatched-lengths", {"x": X, "y": Y[:30]}, [],
     "'{dir}/d.npz': arrays have mismatched lengths {{'x': 40, 'y': 30}}; every array needs the same number of "
     "examples along axis 0."),
    ("empty-dataset", {"x": X[:0], "y": Y[:0]}, [],
     "'{dir}/d.npz': the dataset is empty (0 examples in ['x', 'y']); it needs at least one."),
    ("missing-y", {"x": X}, [], "data.path '{dir}/d.npz' must hold exactly the arrays 'x' and 'y', got ['x']."),
    ("fewer-examples-than-a-batch", {"x": X[:5], "y": Y[:5]}, [],
     "the dataset has 4 examples, fewer than one global batch of 8 with drop_last=True; use global_batch_size "
     "<= 4 or drop_last=False."),
]


def _write_npz(content):
    def setup(d):
        if isinstance(content, bytes):
            (d / "d.npz").write_bytes(content)
        else:
            np.savez(d / "d.npz", **content)
    return setup


def data_case(id, content, args, message) -> Case:
    return Case(id, ["train", "--devices", "2", "--steps", "2", "--set", "data.name=arrays", "--set",
                     "data.path={dir}/d.npz", "--set", "data.batch_size=8", *args, "--workdir", "{dir}/w",
                     "--no-progress"], ["jdp: error: " + message], _write_npz(content))


# Checkpoints: a damaged, foreign or mismatched checkpoint is refused and left exactly as it was.
# (id, damage(the copied workdir's checkpoint 2) or None, extra arguments, the pieces of the message)
def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


UNREADABLE = "jdp: error: checkpoint {step} in '{{dir}}/w/checkpoints' is unreadable ("
REMOVE_IT = "); remove it or use another --workdir."
CHECKPOINT_CASES = [
    ("state-removed", lambda c: shutil.rmtree(c / "state"), [],
     [UNREADABLE.format(step=2) + 'KeyError: Item "state" was not found in the checkpoint', REMOVE_IT]),
    ("state-metadata-truncated", lambda c: _truncate(c / "state" / "_METADATA"), [],
     [UNREADABLE.format(step=2) + "JSONDecodeError: ", REMOVE_IT]),
    ("meta-removed", lambda c: shutil.rmtree(c / "meta"), [],
     [UNREADABLE.format(step=2) + 'KeyError: Item "meta" was not found in the checkpoint', REMOVE_IT]),
    ("meta-truncated", lambda c: _truncate(c / "meta" / "metadata"), [],
     [UNREADABLE.format(step=2) + "JSONDecodeError: ", REMOVE_IT]),
    ("meta-of-another-program", lambda c: (c / "meta" / "metadata").write_text('{"epoch": 3}'), [],
     [UNREADABLE.format(step=2) + "KeyError: its metadata has no 'data_state' and 'run.identity', so jdp did not "
      "write it" + REMOVE_IT]),
    ("other-lr", None, ["--set", "optim.lr=0.001"],
     ["jdp: error: checkpoint 2 in '{dir}/w/checkpoints' was written by a different run (optim.lr: checkpoint "
      "0.003, now 0.001); use another --workdir or the original configuration."]),
    ("other-hidden-and-seed", None, ["--set", "model.hidden=[64]", "--set", "train.seed=1"],
     ["jdp: error: checkpoint 2 in '{dir}/w/checkpoints' was written by a different run (model.hidden: checkpoint "
      "[128], now [64]; train.seed: checkpoint 0, now 1); use another --workdir or the original configuration."]),
]


def checkpoint_case(id, damage, args, pieces) -> Case:
    return Case(id, ["train", *TEMPLATE_ARGS, *args, "--workdir", "{dir}/w", "--no-progress"], pieces,
                None if damage is None else lambda d: damage(d / "w" / "checkpoints" / "2"), template=True)


def _foreign_step_directory(d):
    """checkpoints/1 holding someone else's files: not a jdp checkpoint, and not jdp's to delete."""
    (d / "w" / "checkpoints" / "1").mkdir(parents=True)
    (d / "w" / "checkpoints" / "1" / "notes.txt").write_text("not a checkpoint")


def _file(d):
    (d / "file").write_text("keep me")


def _checkpoints_file(d):
    (d / "w").mkdir()
    (d / "w" / "checkpoints").write_text("keep me")


# The workdir, and jdp plot. (Without write permission: test_workdir_without_write_permission_is_refused.)
OTHER_CASES = [
    Case("foreign-step-directory", ["train", *TEMPLATE_ARGS, "--workdir", "{dir}/w", "--no-progress"],
         [UNREADABLE.format(step=1) + 'KeyError: Item "meta" was not found in the checkpoint', REMOVE_IT],
         _foreign_step_directory),
    Case("workdir-is-a-file", ["train", *TEMPLATE_ARGS, "--workdir", "{dir}/file", "--no-progress"],
         ["jdp: error: --workdir '{dir}/file' exists and is not a directory."], _file),
    Case("workdir-inside-a-file", ["train", *TEMPLATE_ARGS, "--workdir", "{dir}/file/sub", "--no-progress"],
         ["jdp: error: --workdir '{dir}/file/sub' cannot be written (Not a directory: '{dir}/file/sub'); use a "
          "--workdir you can write to."], _file),
    Case("checkpoints-path-is-a-file", ["train", *TEMPLATE_ARGS, "--workdir", "{dir}/w", "--no-progress"],
         ["jdp: error: checkpoint directory '{dir}/w/checkpoints' exists and is not a directory."], _checkpoints_file),
    Case("plot-of-a-missing-run", ["plot", "{dir}/missing"],
         ["jdp: error: '{dir}/missing/metrics.jsonl' does not exist; run `jdp train ... --workdir {dir}/missing` "
          "first."]),
]

CASES = [*(config_case(*c) for c in CONFIG_CASES), *(data_case(*c) for c in DATA_CASES),
         *(checkpoint_case(*c) for c in CHECKPOINT_CASES), *OTHER_CASES]
assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


def _run_case(case: Case, d, template) -> tuple:
    """Set the case up in `d`, snapshot `d`, run jdp: `(completed process, snapshot before)`."""
    if case.template:
        shutil.copytree(template.result(), d / "w")
    if case.setup is not None:
        case.setup(d)
    before = snapshot(d)
    return run_jdp(*(a.format(dir=d) for a in case.argv)), before


def _train_template(directory):
    """A workdir holding a complete 2-step run of the default MLP (checkpoint 2)."""
    r = run_jdp("train", *TEMPLATE_ARGS, "--workdir", str(directory), "--no-progress")
    assert r.returncode == 0, f"the template run failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert (directory / "checkpoints" / "2" / "state").is_dir(), sorted(snapshot(directory))
    return directory


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """{case id: future of (directory, completed process, snapshot before)} for the selected cases.

    The template run trains first; the cases that copy it wait for it (and fail with its error).
    """
    selected = {item.callspec.params["case"].id for item in request.session.items
                if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})}
    cases = [c for c in CASES if c.id in selected]
    base = tmp_path_factory.mktemp("faults")
    with ThreadPoolExecutor(WORKERS) as pool:
        template = (pool.submit(_train_template, base / "template") if any(c.template for c in cases) else None)
        futures = {}
        for case in sorted(cases, key=lambda c: c.template):  # the template's copies last
            d = base / case.id
            d.mkdir()
            futures[case.id] = (d, pool.submit(_run_case, case, d, template))
        yield futures


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_fault_is_refused_and_changes_nothing(case, runs):
    d, future = runs[case.id]
    r, before = future.result()
    assert_refused(r, *(piece.format(dir=d) for piece in case.expected))
    assert snapshot(d) == before


def test_workdir_without_write_permission_is_refused(tmp_path):
    if os.geteuid() == 0:  # root writes through permission bits; sysfs refuses new entries even to root
        if not os.path.isdir("/sys/kernel"):
            pytest.skip("running as root, where permission bits do not stop writes, and there is no /sys "
                        "(which refuses them even to root) to try instead")
        parent, reason = "/sys/jdp-test-faults", "Operation not permitted"
    else:
        parent, reason = str(tmp_path / "read-only"), "Permission denied"
        os.mkdir(parent, 0o500)
    try:
        r = run_jdp("train", *TEMPLATE_ARGS, "--workdir", f"{parent}/w", "--no-progress")
    finally:
        if not parent.startswith("/sys/"):
            os.chmod(parent, 0o700)  # so that pytest can remove tmp_path
    assert_refused(r, f"jdp: error: --workdir '{parent}/w' cannot be written ({reason}: ",
                   "; use a --workdir you can write to.")
    assert not os.path.exists(f"{parent}/w")
