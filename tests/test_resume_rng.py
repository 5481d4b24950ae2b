"""Resume restores everything a run depends on: the counters that derive the per-device keys too.

A model that never draws a random number resumes bit-exactly even when the restored micro-step
is wrong; a dropout model then draws other masks and diverges. And nothing else reads `skipped`
or `skip_streak` back, so they are checked directly after a restore.
"""
import json
import os
import pathlib
import shutil

import jax
import numpy as np
import optax
import pytest

import jdp
from helpers import batches, mlp_loss, mlp_params
from jdp.run.checkpoint import Checkpointer
from jdp.config import load_config
from jdp.train import train

ROOT = pathlib.Path(__file__).parents[1]


def gpt_config():
    """A tiny char GPT with dropout 0.5: 4 optimizer steps, a checkpoint every 2."""
    return load_config(ROOT / "configs" / "char_gpt.yaml", [
        "model.d_model=16", "model.n_heads=2", "model.n_layers=1", "model.context=16", "model.dropout=0.5",
        "data.batch_size=16", "optim.warmup_steps=1",
        "train.steps=4", "train.log_every=1", "train.checkpoint_every=2"])


def logged_losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def test_dropout_model_resumes_bit_exactly(tmp_path):
    """A run that dies after its step-2 checkpoint and restarts equals the uninterrupted run, bit for bit."""
    cfg = gpt_config()
    quiet = dict(devices=jax.devices()[:2], log=lambda *_: None, progress=False)
    whole = train(cfg, str(tmp_path / "whole"), **quiet)
    want = logged_losses(tmp_path / "whole")
    assert [s for s, _ in want] == [1, 2, 3, 4]
    # The crashed run's directory: its step-2 checkpoint, nothing after it (two train() calls, not three).
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "2", tmp_path / "crashed" / "checkpoints" / "2")
    resumed = train(cfg, str(tmp_path / "crashed"), **quiet)
    assert (resumed.resumed_from, resumed.steps) == (2, 4)
    assert logged_losses(tmp_path / "crashed") == want[2:]  # steps 3 and 4 draw the same dropout masks
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(whole.params)):
        np.testing.assert_array_equal(a, b)
    assert resumed.eval == whole.eval


def poisoned(batch):
    x = batch["x"].copy()
    x[0, 0] = np.nan
    return {"x": x, "y": batch["y"]}


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_restore_brings_back_every_counter(tmp_path, backend):
    step = jdp.make_train_step(mlp_loss, optax.adam(1e-2), backend=backend, devices=jax.devices()[:2],
                               accum_steps=2, accum_sync="last", skip_nonfinite=True)
    state = step.init(mlp_params(), seed=3)
    good = batches(2, 16, seed=8)
    for global_batch in (good[0], poisoned(good[1]), good[1], poisoned(good[0])):
        for micro in step.micro_batches(global_batch):
            state, _ = step(state, micro)
    # 4 updates (the poisoned two skipped) of 2 micro-batches; the last one skipped: a streak of 1.
    counters = {k: int(jdp.step.get_tree(state, getattr(state, k))) for k in ("step", "micro_step", "skipped", "skip_streak")}
    assert counters == {"step": 4, "micro_step": 8, "skipped": 2, "skip_streak": 1}

    checkpoints = Checkpointer(str(tmp_path / "checkpoints"))
    run = {"identity": {"test": "counters"}}
    checkpoints.save(4, step, state, {"position": 8}, run)
    checkpoints.wait()
    fresh = step.init(mlp_params(), seed=0)  # another seed: the key must come from the checkpoint
    restored, data_state, number = checkpoints.restore(step, fresh, run)
    checkpoints.close()
    assert (data_state, number) == ({"position": 8}, 4)
    assert {k: int(jdp.step.get_tree(restored, getattr(restored, k))) for k in counters} == counters
    for name in ("params", "opt_state", "rng"):
        for a, b in zip(jax.tree.leaves(jdp.step.get_tree(restored, getattr(restored, name))),
                        jax.tree.leaves(jdp.step.get_tree(state, getattr(state, name)))):
            np.testing.assert_array_equal(a, b, err_msg=name)
