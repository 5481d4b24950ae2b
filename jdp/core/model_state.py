"""Checks on the model state a loss returns (BatchNorm statistics), made once, at a step's first call.

jdp averages the new model state over the devices on every call. That is one device's step only if
the state already agrees on every device (synchronised BatchNorm computes its statistics over the
global batch), and only if the loss hands back the state in the structure it was given: otherwise
the next call traces a new program (a recompilation per step) on a state that grows or resets.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jdp.core.mesh import data_axes
from jdp.core.state import device_key

# Spread across devices, relative to the leaf's largest value, that counts as "the same on every device".
# Synchronised statistics are one all-reduce's result: bit-identical on CPU. Per-device statistics of
# different shards differ by far more (measured here: 1e-3 to 1e-1 of the leaf).
AGREEMENT_RTOL = 1e-5


def _shapes(tree):
    return [(jax.tree_util.keystr(path), tuple(np.shape(x)), jnp.result_type(x).name)
            for path, x in jax.tree_util.tree_leaves_with_path(tree)]


def _describe(tree, limit: int = 4) -> str:
    leaves = _shapes(tree)
    shown = ", ".join(f"{p or '<root>'} {s} {d}" for p, s, d in leaves[:limit])
    return f"{jax.tree.structure(tree).num_leaves} leaves ({shown}{', ...' if len(leaves) > limit else ''})"


def check_structure(given, returned) -> None:
    """Refuse a new model state whose tree structure, shapes or dtypes differ from the state given.

    `given`, `returned`: pytrees of arrays or `jax.ShapeDtypeStruct`s. A Linen loss that returns
    the whole mutable dict (`{'batch_stats': ...}`) where the statistics themselves belong nests
    the collection one level deeper on every call.
    """
    if jax.tree.structure(given) == jax.tree.structure(returned) and _shapes(given) == _shapes(returned):
        return
    hint = ""
    if isinstance(returned, dict) and len(returned) == 1 and jax.tree.structure(next(iter(returned.values()))) \
            == jax.tree.structure(given):
        key = next(iter(returned))
        hint = f" (it is wrapped in {{{key!r}: ...}}: return new_model_state[{key!r}], as Flax's examples do)"
    raise ValueError(f"loss_fn returned a new model state that differs from the one it was given{hint}: given "
                     f"{_describe(given)}, returned {_describe(returned)}; return the same structure, shapes and "
                     f"dtypes, or every call would compile a new step around a state that changes shape.")


def spread_over_devices(loss, mesh, params, model_state, batch, rng, micro_step):
    """Per leaf of the model state `loss` returns on each device's share of `batch`: (max over devices
    of |state - mean over devices|, max |state|), replicated, before jdp averages it.

    `loss(params, model_state, batch, key) -> (loss, (aux, new_model_state))`; `batch` is the
    global batch split along the mesh's axis (N·b rows); `params`, `model_state` one copy.
    """
    axis = data_axes(mesh)

    def per_device(params, model_state, batch, rng, micro_step):
        new = loss(params, model_state, batch, device_key(rng, micro_step, axis))[1][1]
        as_float = jax.tree.map(lambda x: x.astype(jnp.float32), new)
        mean = jax.tree.map(lambda x: lax.pmean(x, axis), as_float)
        spread = jax.tree.map(lambda x, m: lax.pmax(jnp.max(jnp.abs(x - m), initial=0.0), axis), as_float, mean)
        scale = jax.tree.map(lambda x: lax.pmax(jnp.max(jnp.abs(x), initial=0.0), axis), as_float)
        return spread, scale

    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P(axis), P(), P()), out_specs=P(),
                           check_vma=False)
    return jax.device_get(jax.jit(mapped)(params, model_state, batch, rng, micro_step))


def check_agreement(spread, scale, axis: str) -> None:
    """Refuse model state that differs across devices (per-device BatchNorm statistics), naming the worst leaf."""
    worst = None
    for (path, s), c in zip(jax.tree_util.tree_leaves_with_path(spread), jax.tree.leaves(scale)):
        s, c = float(s), float(c)
        if s > AGREEMENT_RTOL * c and (worst is None or s / max(c, 1e-30) > worst[1] / max(worst[2], 1e-30)):
            worst = (jax.tree_util.keystr(path), s, c)
    if worst is None:
        return
    path, s, c = worst
    raise ValueError(f"model_state{path} comes out of loss_fn different on each device (spread {s:.3g} across "
                     f"devices, {s / max(c, 1e-30):.2g} of its largest value), so it was computed from each device's "
                     f"own examples and the step is not one device's: give BatchNorm axis_name={axis!r} (synchronised "
                     f"statistics over the global batch), or pass sync_batchnorm=False to accept per-device "
                     f"statistics, averaged (PyTorch DDP without SyncBatchNorm).")
