"""No run is ever lost: checkpoints under any directory name, verified on restore, always finite, tied
to their data; metrics.jsonl exact after a kill; one sentence for unreadable or unwritable state.

Most runs call `jdp.run.cli.main` or `jdp.train.train` in this process (tiny models, 1-4 steps); the
permission cases run in one child process, which drops root's permission override where needed.
"""
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import tensorstore as ts

from benchmarks.common import child_env
from helpers import cli
from jdp.run.checkpoint import latest_params
from jdp.run.cli import main
from jdp.config import load_config
from jdp.run.metrics import load_metrics, repair_metrics
from jdp.train import train

from test_faults import ROOT, assert_refused, snapshot

# The template run: a digits MLP with 8 hidden units, 2 steps on 2 devices, checkpoints 1 and 2.
ARGS = ["train", "--devices", "2", "--steps", "2", "--checkpoint-every", "1", "--log-every", "1",
        "--set", "data.batch_size=64", "--set", "model.hidden=[8]", "--no-progress"]
# One xdist worker runs this file: the template is trained once.
pytestmark = pytest.mark.xdist_group("test_faults_checkpoint")


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A workdir holding the template run (checkpoints 1 and 2) and its final params."""
    w = tmp_path_factory.mktemp("template") / "w"
    assert main([*ARGS, "--workdir", str(w)]) == 0
    assert sorted(os.listdir(w / "checkpoints")) == ["1", "2"]
    return w, latest_params(str(w))[1]


@pytest.fixture
def workdir(template, tmp_path):
    shutil.copytree(template[0], tmp_path / "w")
    return tmp_path / "w"


# 1. Any directory name a user can create works as a workdir.
@pytest.mark.parametrize("name", ["sweep[1]", "lr[3e-3]", "with space", "ünïcødé ✓", "a*b?c", "relative[2]",
                                  "link[3]"])
def test_any_directory_name_is_a_workdir(tmp_path, monkeypatch, name):
    cfg = load_config(os.path.join(ROOT, "configs", "seed_linear.yaml"), ["train.steps=2"])
    workdir = str(tmp_path / name)
    if name.startswith("relative"):
        monkeypatch.chdir(tmp_path)
        workdir = name
    if name.startswith("link"):
        os.mkdir(tmp_path / "target")
        os.symlink(tmp_path / "target", workdir)
    first = train(cfg, workdir, log=lambda *_: None, progress=False, stop_after=1)
    second = train(cfg, workdir, log=lambda *_: None, progress=False)
    assert (first.steps, second.resumed_from, second.steps) == (1, 1, 2)
    step, params = latest_params(workdir)
    assert step == 2 and jax.tree.all(jax.tree.map(np.array_equal, params, second.params))
    assert [r["step"] for r in load_metrics(workdir)] == [1, 2]


# 2. Checkpoints are verified on restore; falling back to an intact one happens only on request.
def _flip_a_bit(state_dir):
    """Flip the top exponent bit of one saved param the way damaged storage would: the bytes read back
    without error (tensorstore rewrites the chunk, compressed as before), but hold another value."""
    spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{state_dir}/"},
            "path": "params.layers.0.kernel.value"}
    array = ts.open(spec).result()
    values = array.read().result()
    values.view(np.uint32)[0, 0] ^= 1 << 30
    array.write(values).result()


def test_damaged_arrays_are_refused_and_fallback_is_explicit(capsys, template, workdir):
    _flip_a_bit(workdir / "checkpoints" / "2" / "state")
    before = snapshot(workdir)
    r = cli(capsys, *ARGS, "--workdir", workdir)
    assert_refused(r, f"jdp: error: checkpoint 2 in '{workdir}/checkpoints' is damaged: its saved arrays do not "
                      f"match the sha256 recorded when it was saved; rerun with --fallback-to-intact to resume from "
                      f"the newest intact older checkpoint (of 1) and move this one to "
                      f"'{workdir}/checkpoints.damaged', or use another --workdir.")
    assert snapshot(workdir) == before

    r = cli(capsys, *ARGS, "--workdir", workdir, "--fallback-to-intact")
    assert r.returncode == 0, r.stderr
    assert "trying the one before it" in r.stdout and "resumed from step 1" in r.stdout
    # The damaged checkpoint is moved aside intact, and step 2 trained again equals the original.
    assert snapshot(workdir / "checkpoints.damaged" / "2") == {
        os.path.relpath(k, os.path.join("checkpoints", "2")): v for k, v in before.items()
        if k.startswith(os.path.join("checkpoints", "2") + os.sep)}
    step, params = latest_params(str(workdir))
    assert step == 2 and jax.tree.all(jax.tree.map(np.array_equal, params, template[1]))


def test_damaged_data_position_is_refused(capsys, workdir):
    path = workdir / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["data_state"]["step"] += 1  # another position in the epoch: valid JSON, wrong batches
    path.write_text(json.dumps(meta))
    before = snapshot(workdir)
    r = cli(capsys, *ARGS, "--workdir", workdir)
    assert_refused(r, f"jdp: error: checkpoint 2 in '{workdir}/checkpoints' is damaged: its data position and run "
                      f"identity do not match the sha256 recorded when it was saved; rerun with --fallback-to-intact")
    assert snapshot(workdir) == before


def test_fallback_resumes_from_the_newest_intact_checkpoint(tmp_path):
    # Checkpoints 1, 2 and 3 of the seed regression; 3 is damaged. The fallback skips it for 2, the
    # newest intact one, not for 1.
    quiet = dict(log=lambda *_: None, progress=False)
    cfg = load_config(os.path.join(ROOT, "configs", "seed_linear.yaml"), ["train.steps=3", "train.checkpoint_every=1",
                                                                          "train.keep_checkpoints=5"])
    train(cfg, str(tmp_path / "w"), **quiet)
    path = tmp_path / "w" / "checkpoints" / "3" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["data_state"]["step"] += 1
    path.write_text(json.dumps(meta))
    resumed = train(cfg, str(tmp_path / "w"), fallback_to_intact=True, **quiet)
    assert (resumed.resumed_from, resumed.steps) == (2, 3)
    assert os.listdir(tmp_path / "w" / "checkpoints.damaged") == ["3"]


# 3. A non-finite state is never checkpointed, so rotation keeps the newest finite checkpoint.
def test_nonfinite_state_is_never_checkpointed(capsys, tmp_path):
    # SGD at lr 1e12 on the seed regression: finite gradients, the weights grow ~1e13× a step and
    # overflow float32 at step 3. max_nonfinite=0: the step does not skip non-finite updates.
    w = tmp_path / "w"
    r = cli(capsys, "train", os.path.join(ROOT, "configs", "seed_linear.yaml"), "--steps", "5", "--checkpoint-every",
            "1", "--set", "optim.lr=1e12", "--set", "train.keep_checkpoints=1", "--set", "train.max_nonfinite=0",
            "--workdir", w, "--no-progress")
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == ("jdp: training stopped at step 3: its state holds NaN/Inf (first in params['w']), so "
                                "it was not checkpointed; the newest checkpoint, step 2, is finite and kept.")
    assert os.listdir(w / "checkpoints") == ["2"]
    step, params = latest_params(str(w))
    assert step == 2 and jax.tree.all(jax.tree.map(lambda p: np.isfinite(p).all(), params))


# 4. The run identity covers the training data.
def test_resume_on_other_data_is_refused(capsys, tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 5)).astype(np.float32), np.arange(40) % 3
    np.savez(tmp_path / "d.npz", x=x, y=y)
    argv = ["train", "--devices", "2", "--steps", "2", "--set", "data.name=arrays", "--set",
            f"data.path={tmp_path}/d.npz", "--set", "data.batch_size=8", "--set", "model.hidden=[8]", "--workdir",
            tmp_path / "w", "--no-progress"]
    assert cli(capsys, *argv, "--stop-after", "1").returncode == 0
    np.savez(tmp_path / "d.npz", x=x[::-1], y=y)  # the same shapes and config, other examples
    before = snapshot(tmp_path)
    r = cli(capsys, *argv)
    assert_refused(r, f"jdp: error: checkpoint 1 in '{tmp_path}/w/checkpoints' was written by a different run "
                      f"(data.train_arrays_sha256: checkpoint '", "', now '",
                      "'); use another --workdir or the original configuration.")
    assert snapshot(tmp_path) == before


# 5. metrics.jsonl holds each step once after a kill and a resume.
def test_metrics_are_exact_after_a_kill(capsys, tmp_path):
    w = tmp_path / "w"
    argv = [*ARGS, "--steps", "4", "--checkpoint-every", "2", "--workdir", w]
    assert cli(capsys, *argv, "--stop-after", "3").returncode == 0
    step3 = [r for r in load_metrics(str(w)) if r["step"] == 3]
    # As if killed while writing step 4's record, before checkpoint 3 was complete.
    shutil.rmtree(w / "checkpoints" / "3")
    with open(w / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 0.1')
    r = cli(capsys, *argv)
    assert r.returncode == 0, r.stderr
    # Step 3's training record and the record of its evaluation (the end of that invocation).
    assert "dropped 2 record(s) past step 2 and a last line cut mid-record" in r.stdout
    records = [r for r in load_metrics(str(w)) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[2]["loss"] == step3[0]["loss"]  # step 3 trained again, bit for bit


def test_repair_keeps_what_is_not_a_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = ['{"step": 1, "loss": 1.0}', "a note someone added", '{"step": 2, "loss": 0.5}', '{"step": 3}']
    path.write_text("\n".join(lines) + '\n{"step": 4, "lo')
    os.chmod(path, 0o640)
    assert repair_metrics(str(path), 2) is not None
    assert path.read_text() == "\n".join(lines[:3]) + "\n"
    assert os.stat(path).st_mode & 0o777 == 0o640
    inode = os.stat(path).st_ino
    assert repair_metrics(str(path), 2) is None and os.stat(path).st_ino == inode  # nothing to do: not rewritten


# 6. One sentence, and the right advice, for state that cannot be read or written.
def test_metrics_path_that_is_a_directory_is_refused(capsys, workdir):
    os.remove(workdir / "metrics.jsonl")
    os.mkdir(workdir / "metrics.jsonl")
    before = snapshot(workdir)
    r = cli(capsys, *ARGS, "--workdir", workdir)
    assert_refused(r, f"jdp: error: '{workdir}/metrics.jsonl' is a directory, not a metrics file; move it away or "
                      f"use another --workdir.")
    assert snapshot(workdir) == before


_CHILD = """
import contextlib, io, json, sys, traceback
from jdp.run.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except BaseException:
            code = -1
            traceback.print_exc()
    results.append((code, err.getvalue()))
with open(sys.argv[2], "w") as f:
    json.dump(results, f)
"""

# (what is made unreadable or read-only, its mode, the pieces of the message)
PERMISSION_CASES = [
    ("checkpoints/2", 0o000, ["jdp: error: checkpoint 2 in '{w}/checkpoints' cannot be read (", "Permission denied",
                              "); give this user read permission on it or use another --workdir."]),
    ("checkpoints", 0o000, ["jdp: error: checkpoint directory '{w}/checkpoints' cannot be read (permission denied); "
                            "give this user read permission on it or use another --workdir."]),
    ("checkpoints", 0o555, ["jdp: error: checkpoint directory '{w}/checkpoints' cannot be written (permission "
                            "denied); use a --workdir you can write to."]),
    ("", 0o555, ["jdp: error: ", "cannot be written (", "; use a --workdir you can write to."]),  # the whole workdir
]


def test_unreadable_or_unwritable_state_is_refused_in_one_sentence(template, tmp_path):
    """All cases in one child process; as root, without the capabilities that override permissions."""
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root, where permission bits do not stop reads or writes, without setpriv to drop "
                        "the capabilities that override them")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    cases, befores, changed = [], [], []
    for i, (target, mode, _) in enumerate(PERMISSION_CASES):
        w = tmp_path / str(i)
        shutil.copytree(template[0], w)
        befores.append(snapshot(w))
        dirs = [d for d, _, _ in os.walk(w)] if target == "" else [str(w / target)]
        for d in dirs:
            os.chmod(d, mode)
        changed += dirs
        cases.append([*ARGS, "--workdir", str(w)])
    env = child_env()
    try:
        subprocess.run([*prefix, sys.executable, "-W", "error", "-c", _CHILD, json.dumps(cases),
                        str(tmp_path / "results.json")], cwd=ROOT, env=env, timeout=300, check=True)
    finally:
        for d in changed:
            os.chmod(d, 0o755)
    results = json.loads((tmp_path / "results.json").read_text())
    for i, ((code, err), (target, _, pieces)) in enumerate(zip(results, PERMISSION_CASES)):
        w = tmp_path / str(i)
        assert_refused(subprocess.CompletedProcess([], code, "", err), *(p.format(w=w) for p in pieces))
        assert "remove it" not in err
        assert snapshot(w) == befores[i], target
