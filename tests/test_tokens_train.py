"""`jdp train` on token files: bad files refused before anything is written, bit-exact resume, and two
real jax.distributed processes equal to one. Every subprocess has a hard timeout."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.common import child_env
from jdp.run.checkpoint import latest_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_env()
TINY = ["model.name=gpt", "data.name=tokens", "data.vocab_size=64", "model.d_model=16", "model.n_heads=2",
        "model.n_layers=1", "model.context=8", "model.dropout=0.0", "data.batch_size=16", "optim.name=sgd",
        "optim.lr=0.3"]  # SGD: attention's key bias has a true gradient of 0; Adam makes its rounding noise ±lr steps


def sets(*overrides):
    return [x for o in overrides for x in ("--set", o)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    rng.integers(0, 64, 5000).astype(np.uint16).tofile(d / "train.bin")  # 624 windows of 8: 39 steps per epoch
    rng.integers(0, 64, 801).astype(np.uint16).tofile(d / "val.bin")
    return d


def jdp_train(workdir, files, *args, extra=()):
    return [sys.executable, "-m", "jdp.run.cli", "train", "--workdir", str(workdir), "--no-progress", "--log-every", "1",
            *sets(*TINY, f"data.path={files / 'train.bin'}", f"data.val_path={files / 'val.bin'}", *extra), *args]


def run(cmd, timeout=240):
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout)


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def leaves(tree):
    """Every array of a params tree (an nnx.State or a restored dict), in jax's tree order."""
    import jax

    found = [np.asarray(x) for x in jax.tree.leaves(tree)]
    assert found and all(x.dtype.kind == "f" for x in found), "not a tree of float arrays"
    return found


def bad_file(path, kind):
    if kind == "odd size":
        path.write_bytes(np.arange(100, dtype=np.uint16).tobytes() + b"\x01")
    elif kind == "short":
        np.arange(8, dtype=np.uint16).tofile(path)
    else:  # a token id >= vocab_size, in the sample read at start
        np.full(200, 70, np.uint16).tofile(path)
    return path


@pytest.mark.parametrize("kind, message", [
    ("odd size", r"holds 201 bytes, not a whole number of uint16 tokens \(2 bytes each\)"),
    ("short", r"holds 8 tokens, fewer than one window of context_length \+ 1 = 9 tokens"),
    ("id", r"holds the token id 70 at position 0, not below vocab_size=64"),
])
def test_a_bad_token_file_exits_2_before_anything_is_written(tmp_path, files, kind, message):
    import re

    path = bad_file(tmp_path / "bad.bin", kind)
    work = tmp_path / "work"
    r = run(jdp_train(work, files, "--steps", "2", "--devices", "2", extra=[f"data.path={path}"]), timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert re.search(message, r.stderr), r.stderr
    assert not work.exists()  # nothing written, not even the workdir


@pytest.mark.parametrize("overrides, message", [
    (["data.vocab_size=null"], "data.name='tokens' needs data.vocab_size"),
    (["model.name=mlp"], "model.name='mlp' cannot train on data.name='tokens'; mlp takes data.name digits or arrays"),
    (["data.dtype=int16"], "data.dtype must be one of uint8, uint16, uint32, got 'int16'"),
    (["data.val_path=nowhere.bin"], "data.val_path='nowhere.bin' is not a file"),
])
def test_a_bad_token_config_exits_2(tmp_path, files, overrides, message):
    r = run(jdp_train(tmp_path / "w", files, "--steps", "2", extra=overrides), timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "w").exists()


def test_a_missing_token_file_says_how_to_make_it(tmp_path, files):
    # `jdp train char_gpt_tokens` before `jdp data prepare-tokens`, in a fresh folder
    cmd = [sys.executable, "-m", "jdp.run.cli", "train", "char_gpt_tokens", "--workdir", "w", "--steps", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip() == (
        f"jdp: error: data.path='runs/pyref_tokens/train.bin' is not a file (relative paths start at {tmp_path}); "
        f"make the token files with jdp data prepare-tokens INPUT OUTPUT (INPUT a UTF-8 text file, or "
        f"python-reference), which writes OUTPUT/train.bin (data.path) and OUTPUT/val.bin (data.val_path): here "
        f"jdp data prepare-tokens INPUT runs/pyref_tokens."), r.stderr
    # The folder prepare-tokens wrote, where the file in it belongs: the file is named.
    r = subprocess.run([*cmd, "--set", f"data.path={files}"], capture_output=True, text=True, env=ENV, cwd=tmp_path,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == (
        f"jdp: error: data.path={str(files)!r} is a folder without meta.json; name its token file, "
        f"data.path={str(files / 'train.bin')!r}, (and set data.vocab_size), or prepare the folder with jdp data "
        f"prepare-tokens."), r.stderr
    assert os.listdir(tmp_path) == []  # nothing written


def test_training_on_a_token_file_resumes_bit_exactly(tmp_path, files):
    from jdp.config import load_config
    from jdp.train import train

    config = load_config(None, [*TINY, f"data.path={files / 'train.bin'}", f"data.val_path={files / 'val.bin'}",
                                "train.steps=45", "parallel.devices=2", "train.checkpoint_every=0"])
    quiet = dict(log=lambda *a: None, progress=False)
    straight = train(config, str(tmp_path / "straight"), **quiet)
    assert straight.steps == 45 and np.isfinite(straight.eval["loss"])
    with open(tmp_path / "straight" / "metrics.jsonl") as f:  # the loss is per token: the step's tokens are logged
        weights = {r["weight"] for r in map(json.loads, f) if "loss" in r}
    assert weights == {16.0 * 8}  # data.batch_size windows × model.context tokens
    first = train(config, str(tmp_path / "resumed"), stop_after=20, **quiet)  # mid-epoch 0 (39 steps per epoch)
    assert first.steps == 20
    second = train(config, str(tmp_path / "resumed"), **quiet)  # crosses into epoch 1
    assert (second.resumed_from, second.steps) == (20, 45)
    for a, b in zip(leaves(second.params), leaves(straight.params)):
        np.testing.assert_array_equal(a, b)
    assert second.eval == straight.eval


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_on_a_token_file_equal_one_process_and_one_device(tmp_path, files):
    one = tmp_path / "one"
    r = run(jdp_train(one, files, "--steps", "6", "--devices", "4"))
    assert r.returncode == 0, r.stderr[-2000:]
    port, work = free_port(), tmp_path / "two"
    procs = [subprocess.Popen(jdp_train(work, files, "--steps", "6", "--devices", "2", "--coordinator",
                                        f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
                                        "--init-timeout", "30"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
             for i in range(2)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    np.testing.assert_allclose(list(losses(work).values()), list(losses(one).values()), rtol=1e-6)
    one_device = tmp_path / "one_device"  # the reference: one device on the whole global batch
    r = run(jdp_train(one_device, files, "--steps", "6", "--devices", "1"))
    assert r.returncode == 0, r.stderr[-2000:]
    np.testing.assert_allclose(list(losses(work).values()), list(losses(one_device).values()), rtol=1e-5)
    (s_two, p_two), (s_one, p_one) = latest_params(work), latest_params(one)
    assert s_two == s_one == 6
    for a, b in zip(leaves(p_two), leaves(p_one)):
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_prepare_tokens_writes_byte_tokens_split_as_the_char_corpus(tmp_path):
    from jdp.data import load_char_corpus

    r = run([sys.executable, "examples/prepare_tokens.py", "--out", str(tmp_path / "ref")], timeout=120)
    assert r.returncode == 0, r.stderr
    corpus = load_char_corpus()
    train, val = (np.fromfile(tmp_path / "ref" / f"{n}.bin", np.uint16) for n in ("train", "val"))
    assert bytes(train.astype(np.uint8)).decode("utf-8") == corpus.decode(corpus.train)
    assert bytes(val.astype(np.uint8)).decode("utf-8") == corpus.decode(corpus.val)
    assert f"train.bin: {len(train):,} tokens ({len(corpus.train):,} characters)" in r.stdout
    (tmp_path / "mine.txt").write_text("héllo wörld\n" * 50, encoding="utf-8")
    r = run([sys.executable, "examples/prepare_tokens.py", "--text", str(tmp_path / "mine.txt"), "--out",
             str(tmp_path / "mine"), "--val-fraction", "0.5"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert np.fromfile(tmp_path / "mine" / "val.bin", np.uint16).tobytes()[::2].decode() == "héllo wörld\n" * 25
    r = run([sys.executable, "examples/prepare_tokens.py", "--out", str(tmp_path / "x"), "--val-fraction", "1"],
            timeout=120)
    assert r.returncode == 2 and "--val-fraction 1.0 must be strictly between 0 and 1" in r.stderr


def noisy(example, rng):
    """A random transform for the trainer: the image plus noise from (seed, epoch, index)."""
    return {"x": example["x"] + 0.1 * rng.standard_normal(example["x"].shape).astype(np.float32),
            "y": example["y"]}


def test_jdp_nnx_task_trains_on_a_grain_source_with_a_transform_and_resumes_bit_exactly(tmp_path):
    import grain
    import optax
    from flax import nnx

    import jdp
    from jdp.config import load_config
    from jdp.train import train

    x, y, xt, yt = jdp.data.load_digits()
    source = grain.MapDataset.range(len(x)).map(lambda i: {"x": x[i], "y": y[i]})

    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    def metric_fn(model, batch):
        return {"loss": optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])}

    def task(transform):
        model = nnx.Linear(64, 10, rngs=nnx.Rngs(0))
        return jdp.nnx.task(model, loss_fn, metric_fn, source, {"x": xt, "y": yt}, transform=transform)

    config = load_config(None, ["train.steps=30", "data.batch_size=64", "parallel.devices=2", "optim.name=sgd",
                                "optim.lr=0.5"])  # 22 steps per epoch: the resume crosses into epoch 1
    quiet = dict(log=lambda *a: None, progress=False)
    straight = train(config, str(tmp_path / "straight"), task=task(noisy), **quiet)
    train(config, str(tmp_path / "resumed"), task=task(noisy), stop_after=12, **quiet)
    resumed = train(config, str(tmp_path / "resumed"), task=task(noisy), **quiet)
    assert resumed.resumed_from == 12
    for a, b in zip(leaves(resumed.params), leaves(straight.params)):
        np.testing.assert_array_equal(a, b)
    plain = train(config, str(tmp_path / "plain"), task=task(None), **quiet)
    assert not np.array_equal(leaves(plain.params)[0], leaves(straight.params)[0])  # the transform ran
    workers = train(apply_workers(config), str(tmp_path / "workers"), task=task(noisy), **quiet)
    for a, b in zip(leaves(workers.params), leaves(straight.params)):  # 2 grain worker processes: the same run
        np.testing.assert_array_equal(a, b)


def apply_workers(config):
    from jdp.config import apply_overrides

    return apply_overrides(config, ["data.workers=2"])


def test_the_run_identity_hashes_arrays_as_before_and_a_token_file_by_its_sample(tmp_path, files):
    import shutil

    from jdp.run.digests import tree_digest, with_data_digest
    from jdp.config import load_config
    from jdp.data import ArrayDataset, load_tokens
    from jdp.train import train

    arrays = {"x": np.arange(12.0).reshape(6, 2), "y": np.arange(6)}
    # Runs on arrays keep the identity their checkpoints hold: the whole arrays' sha256, as before.
    assert with_data_digest({}, ArrayDataset(arrays))["data"]["train_arrays_sha256"] == tree_digest(arrays)[:16]
    path = tmp_path / "train.bin"
    shutil.copy(files / "train.bin", path)
    tokens = load_tokens(path, context_length=8)
    assert with_data_digest({}, tokens)["data"]["train_arrays_sha256"] == tokens.digest()[:16]
    config = load_config(None, [*TINY, f"data.path={path}", "train.steps=4", "parallel.devices=2"])
    train(config, str(tmp_path / "w"), stop_after=2, log=lambda *a: None, progress=False)
    edited = np.fromfile(path, np.uint16)
    edited[:10] = (edited[:10] + 1) % 64  # the same size, new content in the first (always sampled) block
    edited.tofile(path)
    with pytest.raises(ValueError, match=r"was written by a different run \(data.train_arrays_sha256: checkpoint"):
        train(config, str(tmp_path / "w"), log=lambda *a: None, progress=False)
