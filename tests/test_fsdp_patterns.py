"""Your own scanned model under per-layer FSDP: a Flax NNX stack with nnx.scan/nnx.remat and a Flax Linen stack with
nn.scan/nn.remat, each gathering one layer inside the scan body, equal one device; the loop holds the gathers."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import jdp
import jdp.linen
from jdp.inspect.comm import parse_collectives
from tests.helpers import max_abs_diff

LAYERS, PER_LAYER = 3, 4  # each layer: two Linear/Dense layers' kernel and bias
RNG = np.random.default_rng(0)
DATA = [{"x": RNG.normal(size=(16, 12)).astype(np.float32), "y": RNG.integers(0, 5, 16).astype(np.int32)}
        for _ in range(3)]
OPTIMIZER = lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.3, momentum=0.9))  # noqa: E731


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


def gathered(module: nnx.Module) -> nnx.Module:
    """A copy of `module` with its params whole (`jdp.fsdp.gather`: the identity outside per-layer FSDP)."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jdp.fsdp.gather(state))


class NNXStack(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.layers = make(rngs)  # params stacked along a leading axis of LAYERS
        self.inp, self.out = nnx.Linear(12, 16, rngs=rngs), nnx.Linear(16, 5, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def forward(x, block):
            return gathered(block)(x)  # this layer whole, inside the body only

        return gathered(self.out)(forward(gathered(self.inp)(x), self.layers))


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(16)(jnp.tanh(nn.Dense(32)(x))), None


class LinenStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        def gathering(module):  # the module's params made whole as it reads them
            return nn.map_variables(module, "params", trans_in_fn=jdp.fsdp.gather, init=True)

        scanned = nn.scan(nn.remat(gathering(LinenBlock)), variable_axes={"params": 0}, split_rngs={"params": True},
                          length=LAYERS)
        x, _ = scanned()(gathering(nn.Dense)(16)(x), None)
        return gathering(nn.Dense)(5)(x)


def nnx_run(n, **options):
    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    step = jdp.nnx.make_train_step(NNXStack(nnx.Rngs(0)), loss_fn, OPTIMIZER(), devices=jax.devices()[:n], **options)
    state = step.init()
    for batch in DATA:
        state, _ = step(state, batch)
    return step, state


def linen_run(n, **options):
    model = LinenStack()
    start = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), jnp.zeros((1, 12)))["params"],
                              tx=OPTIMIZER())

    def loss_fn(params, batch):
        logits = start.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    step, state = jdp.linen.make_train_step(start, loss_fn, devices=jax.devices()[:n], **options)
    for batch in DATA:
        state, _ = step(state, batch)
    return step, state


@pytest.mark.parametrize("run", [nnx_run, linen_run], ids=["nnx", "linen"])
def test_scanned_model_gathers_per_layer_and_equals_one_device(run):
    _, one = run(1)
    step, sharded = run(4, shard_params=True, gather_in_model=True)
    assert max_abs_diff(jdp.get_params(sharded), jdp.get_params(one)) <= 3e-7
    hlo = step.lower(sharded, DATA[0]).compile().as_text()
    bodies = set(re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo))
    inside = [c["kind"] for c in parse_collectives(hlo) if c["computation"] in bodies]
    assert inside.count("reduce-scatter") == PER_LAYER and inside.count("all-gather") >= PER_LAYER
