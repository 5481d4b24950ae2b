"""The trainer's psum + exact-correction + local-accumulation run, resumed, equals plain one-device JAX.

Bit-exact resume only says that the split run equals the uninterrupted one; both can be wrong
together. Here the resumed run is compared with an independent reference: optax on one device,
the mean-reduction hyperparameters, on the same global batches. Adam's ε (1e-3) and the clip
threshold (1.0; the gradient norms are 0.67, 0.72, 1.03, 0.69) make a wrong scale visible: a
correction that forgot ε × N or clip × N, or a sum over the M micro-batches, moves the params by
~1e-3, fifty times the tolerance.
"""
import json
import os

import jax
import numpy as np
import optax

from helpers import max_abs_diff, reference_grad_norms, reference_run
from jdp.config import load_config
from jdp.data import make_batches
from jdp.run.tasks import build_task
from jdp.train import train

STEPS, N = 4, 4
OVERRIDES = [f"train.steps={STEPS}", "train.log_every=1", "train.checkpoint_every=2", "data.batch_size=64",
             "optim.eps=1e-3", "optim.clip_norm=1.0", "parallel.accum_steps=2", "parallel.accum_sync=last",
             "parallel.reduction=sum", "parallel.lr_correction=exact"]


def test_resumed_psum_exact_accumulated_run_equals_one_device(tmp_path):
    cfg = load_config(None, OVERRIDES)
    quiet = dict(devices=jax.devices()[:N], log=lambda *_: None, progress=False)
    train(cfg, str(tmp_path), stop_after=2, **quiet)
    resumed = train(cfg, str(tmp_path), **quiet)
    assert (resumed.resumed_from, resumed.steps) == (2, STEPS)
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]

    # The reference: the task's loss on whole global batches, Adam as the mean run would use it.
    task = build_task(cfg)
    it = make_batches(task.train, cfg.data.batch_size, seed=cfg.train.seed, drop_last=cfg.data.drop_last, prefetch=0)
    data = [next(it) for _ in range(STEPS)]
    it.close()

    def loss_fn(params, batch):
        return task.loss_fn(params, task.model_state, batch, None)[0]

    def adam():
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-3, eps=1e-3))

    norms = reference_grad_norms(loss_fn, adam(), task.params, data)
    assert any(n > 1.0 for n in norms) and any(n < 1.0 for n in norms), norms  # clips some steps only
    ref_params, ref_losses = reference_run(loss_fn, adam(), task.params, data)
    assert max_abs_diff(resumed.params, ref_params) <= 2e-5
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
