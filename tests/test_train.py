"""The training loop: bit-exact resume, resume on another device count, refusal, exact evaluation."""
import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from jdp.run.checkpoint import CheckpointMismatchError
from jdp.config import Config, load_config
from jdp.core.evaluate import evaluate, make_eval_step
from jdp.core.mesh import make_mesh
from jdp.run.tasks import build_task
from jdp.train import train

from helpers import max_abs_diff


def config(extra=()):
    """6 steps of the default digits MLP, logging every step and checkpointing every 2."""
    return load_config(None, ["train.steps=6", "train.log_every=1", "train.checkpoint_every=2",
                              "data.batch_size=64", *extra])


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def run(cfg, workdir, n, stop_after=None):
    return train(cfg, str(workdir), devices=jax.devices()[:n], log=lambda *_: None, progress=False,
                 stop_after=stop_after)


@pytest.mark.parametrize("sets", [{}, {"parallel.accum_steps": 2, "parallel.accum_sync": "last",
                                       "parallel.reduction": "sum", "parallel.lr_correction": "exact"},
                                  {"parallel.backend": "pmap"}],
                         ids=["mean", "accum-last-psum-exact", "pmap"])
def test_stop_and_resume_is_bit_exact(tmp_path, sets):
    cfg = config(extra=[f"{k}={v}" for k, v in sets.items()])
    whole = run(cfg, tmp_path / "whole", 4)
    first = run(cfg, tmp_path / "split", 4, stop_after=3)
    assert first.steps == 3
    second = run(cfg, tmp_path / "split", 4)
    assert second.resumed_from == 3 and second.steps == 6
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")  # every logged loss, bit for bit
    assert max_abs_diff(second.params, whole.params) == 0.0
    assert second.eval == whole.eval


def test_resume_on_another_device_count(tmp_path):
    cfg = config()
    whole = run(cfg, tmp_path / "whole", 4)
    run(cfg, tmp_path / "moved", 4, stop_after=3)
    resumed = run(cfg, tmp_path / "moved", 2)
    assert resumed.resumed_from == 3
    assert max_abs_diff(resumed.params, whole.params) <= 1e-5
    np.testing.assert_allclose(list(losses(tmp_path / "moved").values()), list(losses(tmp_path / "whole").values()),
                               rtol=1e-5)


def _snapshot(directory):
    return {os.path.relpath(os.path.join(d, f), directory): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, files in os.walk(directory) for f in files}


@pytest.mark.parametrize("change,named", [
    ("optim.lr=0.001", "optim.lr: checkpoint 0.003, now 0.001"),
    ("model.hidden=[64]", "model.hidden: checkpoint [128], now [64]"),
    ("optim.name=sgd", "optim.name: checkpoint 'adam', now 'sgd'"),
])
def test_mismatched_config_is_refused_and_checkpoint_untouched(tmp_path, change, named):
    run(config(), tmp_path / "w", 2, stop_after=2)
    before = _snapshot(tmp_path / "w")
    with pytest.raises(CheckpointMismatchError, match=named.replace("[", r"\[").replace("]", r"\]")):
        run(load_config(None, ["train.steps=6", "data.batch_size=64", "train.log_every=1", change]), tmp_path / "w", 2)
    assert _snapshot(tmp_path / "w") == before


def test_evaluation_is_exact_with_a_ragged_last_batch():
    task = build_task(Config())
    mesh = make_mesh(jax.devices()[:4])
    x, y = task.test.arrays["x"], task.test.arrays["y"]
    assert len(x) % 100  # 359 examples: the last batch of 100 is padded
    got = evaluate(make_eval_step(task.metric_fn, mesh), task.params, task.model_state, task.test, 100, mesh)
    logits = np.asarray(jax.jit(lambda p, x: task.metric_fn(p, task.model_state, {"x": x, "y": y}))(task.params, x)
                        ["accuracy"])
    np.testing.assert_allclose(got["accuracy"], logits.mean(), rtol=1e-6)
    assert 0.0 < got["accuracy"] < 0.5  # an untrained model: far from the trained 0.98, not trivially 0


def test_evaluation_leaves_the_padding_of_the_last_batch_out():
    # 10 examples in batches of 8 on 4 devices: the last batch holds 2 real examples and 6 padded
    # ones. Each example's value is x + 100, so a padded example counted in the sum (or the count)
    # moves the mean far from the real one, 105.5.
    mesh = make_mesh(jax.devices()[:4])
    data = {"x": np.arange(1, 11, dtype=np.float32)}
    step = make_eval_step(lambda offset, _, batch: {"v": batch["x"] + offset}, mesh)
    assert evaluate(step, np.float32(100), (), data, 8, mesh) == {"v": 105.5}


def test_consecutive_nonfinite_updates_stop_training(tmp_path, monkeypatch):
    import jdp.run.train as train_module

    real = train_module.build_task

    def poisoned(config):  # NaN inputs get past nothing in real data (tasks refuse them): inject here
        task = real(config)
        x = task.train.arrays["x"].copy()
        x[:, 0] = np.nan
        return dataclasses.replace(task, train=type(task.train)({"x": x, "y": task.train.arrays["y"]}))

    monkeypatch.setattr(train_module, "build_task", poisoned)
    cfg = load_config(None, ["train.steps=10", "train.log_every=1", "train.max_nonfinite=2", "data.batch_size=64"])
    with pytest.raises(train_module.NonFiniteError, match=r"stopped at step 2: the last 2 updates had non-finite "
                                                          r"gradients \(train.max_nonfinite=2\)"):
        run(cfg, tmp_path / "nan", 2)


def read_scalars(directory):
    """{tag: [(step, value)]} from the TFRecord event files tensorboardX wrote (length, crc, data, crc)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            blob = f.read()
        at = 0
        while at < len(blob):
            (length,) = struct.unpack("<Q", blob[at:at + 8])
            event = Event.FromString(blob[at + 12:at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_tensorboard_scalars(tmp_path):
    train(config(), str(tmp_path / "tb"), devices=jax.devices()[:2], log=lambda *_: None, progress=False,
          tensorboard=True)
    got = read_scalars(tmp_path / "tb" / "tensorboard")
    assert [step for step, _ in got["loss"]] == list(range(1, 7))
    np.testing.assert_allclose([v for _, v in got["loss"]], [losses(tmp_path / "tb")[s] for s in range(1, 7)],
                               rtol=1e-6)
    assert "eval_accuracy" in got and "lr" in got


def test_sharded_optimizer_state_checkpoints_resume_with_or_without_it(tmp_path):
    cfg = config(extra=["optim.clip_norm=1.0"])
    sharded = config(extra=["optim.clip_norm=1.0", "parallel.shard_optimizer_state=true"])
    whole = run(cfg, tmp_path / "whole", 4)
    run(sharded, tmp_path / "a", 8, stop_after=2)  # sharded on 8 devices ...
    run(cfg, tmp_path / "a", 2, stop_after=2)  # ... replicated on 2 ...
    last = run(sharded, tmp_path / "a", 4)  # ... and sharded on 4 again: one run
    assert last.resumed_from == 4 and last.steps == 6
    assert max_abs_diff(last.params, whole.params) <= 2e-6
    np.testing.assert_allclose(list(losses(tmp_path / "a").values()), list(losses(tmp_path / "whole").values()),
                               rtol=1e-5)
