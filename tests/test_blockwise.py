"""Functions written for whole arrays, run on each device's blocks: the whole result, block by block."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jdp.core.blockwise import WHOLE, blockwise
from jdp.core.zero import spec, split_dim

N = 4
MESH = Mesh(np.array(jax.devices()[:N]), ("data",))
RNG = np.random.default_rng(0)
ARGS = {"a": RNG.normal(size=(8, 12)).astype(np.float32), "b": RNG.normal(size=(12,)).astype(np.float32),
        "c": RNG.normal(size=(4, 8, 12)).astype(np.float32), "d": RNG.normal(size=(5,)).astype(np.float32)}


def on_blocks(fn, args, dims):
    """`fn(args)` evaluated by `blockwise` on N devices' blocks (split along `dims`), gathered back whole."""
    whole = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    out_shape = jax.eval_shape(fn, whole)
    out_dims = jax.tree.map(lambda x: split_dim(x.shape, N), out_shape)
    in_specs = jax.tree.map(lambda d, x: spec(d, x.ndim, "data"), dims, args)
    out_specs = jax.tree.map(lambda d, x: spec(d, len(x.shape), "data"), out_dims, out_shape)
    found = []

    def body(local):
        out, gathered = blockwise(fn, (whole,), (local,), (dims,), out_dims, "data", N)
        found.extend(gathered)
        return out

    mapped = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(in_specs,), out_specs=out_specs, check_vma=False))
    return jax.device_get(mapped(args)), found


FUNCTIONS = {
    "elementwise_and_broadcast": lambda t: {"a": jnp.tanh(t["a"]) * t["b"] + jnp.sum(t["a"], axis=1, keepdims=True) ** 2,
                                            "c": jnp.where(t["c"] > 0, t["c"], 0.5) / jnp.sum(t["d"])},
    "reductions": lambda t: {"sum": jnp.sum(t["a"] ** 2) + jnp.max(t["c"]) - jnp.min(t["b"]),
                             "rows": jnp.mean(t["a"], axis=1), "cols": jnp.mean(t["a"], axis=0),
                             "c": jnp.sum(t["c"], axis=(0, 2))},
    "norms_and_dots": lambda t: {"norm": optax.tree.norm(t), "vdot": jnp.tensordot(t["a"], t["a"], 2),
                                 "mv": t["a"] @ t["b"], "outer": jnp.outer(t["a"].sum(1), t["b"])},
    # (1, 2, 0) is not its own inverse, as a 2-D `.T` is: a transpose rule that inverts it puts the split elsewhere
    "shapes": lambda t: {"t": t["a"].T * 2, "t3": jnp.transpose(t["c"], (1, 2, 0)) - 1,
                         "r": t["c"].reshape(4, 96) + 1, "sq": t["c"][..., :1].squeeze(2) * 3},
    # a sort, a cumulative sum, a flattening that interleaves the blocks: computed on gathered values
    "gathered": lambda t: {"sorted": jnp.sort(t["a"], axis=0), "cum": jnp.cumsum(t["b"]),
                           "flat": t["c"].reshape(-1)[::7]},
    "cond": lambda t: [jax.lax.cond(jnp.sum(t["b"]) > c, lambda a: a * 2, lambda a: a - 1, t["a"]) for c in (-1e9, 1e9)],
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_blockwise_equals_the_whole_function(name):
    fn = FUNCTIONS[name]
    want = jax.device_get(jax.jit(fn)(ARGS))
    for dims in ({"a": 0, "b": 0, "c": 1, "d": WHOLE}, {"a": 1, "b": WHOLE, "c": 0, "d": WHOLE}):
        got, gathered = on_blocks(fn, ARGS, dims)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(x, y, rtol=2e-6, atol=2e-6)
        # only what no rule keeps in blocks runs on all-gathered values
        assert bool(gathered) == (name == "gathered"), gathered


def test_a_collective_inside_the_function_is_refused():
    whole = jax.ShapeDtypeStruct((8,), np.float32)

    def body(x):
        return blockwise(lambda v: jax.lax.psum(v, "data"), (whole,), (x,), (0,), 0, "data", N)[0]

    mapped = jax.shard_map(body, mesh=MESH, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    with pytest.raises(ValueError, match=r"^the optimizer's update calls the collective 'psum'"):
        jax.jit(mapped)(np.ones(8, np.float32))
