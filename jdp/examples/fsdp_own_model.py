"""Your own scanned model under per-layer FSDP, in Flax NNX and in Flax Linen.

    python -m jdp.examples.fsdp_own_model

Each model runs a stack of blocks in a scan over a rematerialised body and gathers one block's
params inside the body (`jdp.fsdp.gathered`), so under `shard_params=True, gather_in_model=True` a
device holds one layer whole at a time and the backward pass reduce-scatters each layer's
gradient as it makes it. Outside that layout `jdp.fsdp.gathered` changes nothing: the same
model code runs on one device, replicated or under ZeRO-1. The script trains each model 3 steps
on one device and on 4 devices with per-layer FSDP, checks that the params agree, and prints the
collectives the compiled step runs inside its scan loop (`jdp.comm_report`'s `in_loop`).
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training.train_state import TrainState

import jdp
import jdp.linen
from jdp.fsdp import gathered

LAYERS = 3
RNG = np.random.default_rng(0)
DATA = [{"x": RNG.normal(size=(16, 12)).astype(np.float32), "y": RNG.integers(0, 5, 16).astype(np.int32)}
        for _ in range(3)]


def optimizer():  # clipping as written: the norm is over the whole gradient in every layout
    return optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.3, momentum=0.9))


# Flax NNX: stack the blocks with nnx.vmap, run them with nnx.scan over an nnx.remat'd body, and call each
# module through gathered(module): a copy of it whose params are whole.
class Block(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


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


# Flax Linen: each module class goes through gathered(module), which wraps it in
# nn.map_variables(..., trans_in_fn=jdp.fsdp.gather) so it reads its params whole; the wrapped block is
# scanned with nn.scan over nn.remat.
class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(16)(jnp.tanh(nn.Dense(32)(x))), None


class LinenStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        scanned = nn.scan(nn.remat(gathered(LinenBlock)), variable_axes={"params": 0}, split_rngs={"params": True},
                          length=LAYERS)
        x, _ = scanned()(gathered(nn.Dense)(16)(x), None)
        return gathered(nn.Dense)(5)(x)


def nnx_run(n, **options):
    """(step, state) after the 3 batches on n devices: the NNX model through `jdp.nnx`."""
    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    step = jdp.nnx.make_train_step(NNXStack(nnx.Rngs(0)), loss_fn, optimizer(), devices=jax.devices()[:n], **options)
    state = step.init()
    for batch in DATA:
        state, _ = step(state, batch)
    return step, state


def linen_run(n, **options):
    """(step, state) after the 3 batches on n devices: the Linen model's TrainState through `jdp.linen`."""
    model = LinenStack()
    start = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), jnp.zeros((1, 12)))["params"],
                              tx=optimizer())

    def loss_fn(params, batch):
        logits = start.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    step, state = jdp.linen.make_train_step(start, loss_fn, devices=jax.devices()[:n], **options)
    for batch in DATA:
        state, _ = step(state, batch)
    return step, state


def in_the_loop(step, state) -> list[str]:
    """The kinds of the collectives the compiled step runs inside its scan loops (once per layer each)."""
    return [c.kind for c in jdp.comm_report(step, state, DATA[0]).collectives if c.in_loop]


if __name__ == "__main__":
    jdp.cpu.use_cpu_devices(4)  # on a CPU-only machine; before any jax computation
    for name, run in (("nnx", nnx_run), ("linen", linen_run)):
        _, one = run(1)
        step, sharded = run(4, shard_params=True, gather_in_model=True)
        for a, b in zip(jax.tree.leaves(jdp.get_params(sharded)), jax.tree.leaves(jdp.get_params(one))):
            np.testing.assert_allclose(a, b, atol=3e-7)  # the step one device takes on the global batch
        inside = in_the_loop(step, sharded)
        print(f"{name}: equal to one device; gathered {jdp.memory_report(step, sharded).gathered}; inside the scan: "
              f"{inside.count('all-gather')} all-gathers, {inside.count('reduce-scatter')} reduce-scatters")
