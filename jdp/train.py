"""The training loop: data -> step -> evaluation -> logging, in one readable function."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdp.data import make_batches
from jdp.models import functional
from jdp.step import get_params, make_train_step


@dataclass(frozen=True)
class TrainResult:
    """What a finished run reports."""

    final_loss: float  # training loss (global-batch mean) of the last step
    test_accuracy: float  # accuracy over the whole test set
    steps: int
    seconds: float  # wall time of the loop, compilation included
    params: object  # host numpy params


def train_classifier(model, data, optimizer: optax.GradientTransformation, *, steps: int, batch_size: int,
                     devices=None, backend: str = "shard_map", seed: int = 0, log_every: int = 50,
                     log: Callable[[str], None] = print) -> TrainResult:
    """Train an `nnx.Module` classifier on `(x_train, y_train, x_test, y_test)` with softmax cross-entropy."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be at least 1.")
    x_train, y_train, x_test, y_test = data
    fm = functional(model)

    def loss_fn(params, batch):
        logits = fm.apply(params, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}

    step = make_train_step(loss_fn, optimizer, backend=backend, devices=devices, has_aux=True)
    state = step.init(fm.params, seed=seed)
    batches = make_batches({"x": x_train, "y": y_train}, batch_size, seed=seed)
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        state, metrics = step(state, next(batches))
        if i % log_every == 0 or i == steps:  # the only host syncs: at log steps
            m = jax.device_get(metrics)
            log(f"step {i:5d}  loss {m['loss']:.4f}  train acc {m['aux']['accuracy']:.3f}  "
                f"({i * batch_size / (time.perf_counter() - t0):,.0f} samples/s on {step.num_devices} "
                f"{step.devices[0].platform} device(s), {backend})")
    params = get_params(state)
    logits = jax.jit(fm.apply)(params, jnp.asarray(x_test))
    accuracy = float(np.mean(np.asarray(logits).argmax(-1) == y_test))
    return TrainResult(float(m["loss"]), accuracy, steps, time.perf_counter() - t0, params)
