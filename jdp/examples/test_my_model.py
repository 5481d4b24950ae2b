"""Copy this into your own test suite: your model takes, on N devices, the steps one device takes.

Run it on 4 fake CPU devices (no accelerator needed):

    pytest -p jdp.testing --jdp-devices 4 --pyargs jdp.examples.test_my_model   # a checkout: examples/test_my_model.py

or put `addopts = "-p jdp.testing"` and `jdp_devices = "4"` under `[tool.pytest.ini_options]` in
your pyproject.toml and run `pytest`. Replace `MyModel`, `loss_fn` and the batches with yours.
"""
import numpy as np
import optax
from flax import nnx

from jdp.testing import assert_data_parallel_exact


class MyModel(nnx.Module):  # any nnx.Module; BatchNorm is fine, Dropout must be off for this test
    def __init__(self, *, rngs):
        self.linear = nnx.Linear(10, 32, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.head = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.bn(self.linear(x))))


def loss_fn(model, batch):  # the MEAN loss over the examples it is given, written for one device
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


def global_batches(num, size, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(size, 10)).astype(np.float32), "y": rng.integers(0, 4, size).astype(np.int32)}
            for _ in range(num)]


def test_my_model_takes_the_one_device_steps(jdp_devices):
    n = len(jdp_devices)
    # 3 optimizer steps, each of 2 micro-batches (accum_steps) x n devices x 4 examples.
    report = assert_data_parallel_exact(loss_fn, optax.adam(1e-2), MyModel(rngs=nnx.Rngs(0)),
                                        global_batches(3, 2 * n * 4), devices=jdp_devices, has_aux=True,
                                        accum_steps=2)
    print(report)  # every leaf of every run (shard_map and pmap, accum_sync "every" and "last")
