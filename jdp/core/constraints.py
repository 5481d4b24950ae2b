"""A model that constrains the sharding of its values while it runs, under the per-device backends.

Code written for `jax.jit` on a mesh may call `jax.lax.with_sharding_constraint` inside the model:
on activations (`nn.with_logical_constraint`, a hand-written constraint), or through Flax itself
(a Linen param boxed by `nn.with_partitioning` is unboxed with a constraint when Flax re-runs its
initializer to check the param's shape, as `nn.DenseGeneral`'s does). A constraint names how a
GLOBAL array lies on the mesh. Under `backend="shard_map"` (and jdp's `"pmap"`) the loss sees one
device's shard inside a mesh whose axes are manual, where the constraint has no meaning and JAX or
Flax fail with an error about ranks or meshes.

jdp sets the params' annotations aside under the per-device backends (each device holds whole
params), but cannot set aside a constraint the model's own code makes: the loss is run as it is,
and such a failure is refused in one sentence that names the way to run the model as written,
`backend="jit"`, where the loss sees global arrays and jdp honours the annotations.
"""
from __future__ import annotations

import functools
from collections.abc import Callable


def refusal(backend: str, error: BaseException) -> str:
    """The sentence a sharding constraint inside the loss gets under `backend`."""
    return (f"the model constrains how its values lie on a mesh while it runs (jax.lax.with_sharding_constraint, "
            f"e.g. Flax's nn.with_logical_constraint or the unboxing of nn.with_partitioning params), which has no "
            f"meaning on one device's shard under backend={backend!r}; run it with backend='jit', where the loss "
            f"sees global arrays and the annotations are honoured (the constraint's own error: "
            f"{str(error).splitlines()[0][:160]}).")


def constraints_refused(loss_fn: Callable, backend: str) -> Callable:
    """`loss_fn`, whose failure in a sharding constraint under a per-device `backend` is a ValueError
    naming backend="jit" (under "jit" `loss_fn` itself: there the constraints hold)."""
    if backend == "jit":
        return loss_fn

    @functools.wraps(loss_fn)
    def guarded(*args, **kwargs):
        try:
            return loss_fn(*args, **kwargs)
        except (ValueError, RuntimeError) as e:
            if "with_sharding_constraint" not in str(e):
                raise
            raise ValueError(refusal(backend, e)) from None

    return guarded
