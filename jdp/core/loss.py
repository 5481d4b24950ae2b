"""The loss as the user declared it, called in the one form the step differentiates.

`call_loss` calls `loss_fn` with the arguments its options declare (model state, key), checks what it
returns, and hands the algorithm `(total, (aux, new_model_state, weight))`: the loss as a sum over
this device's examples or tokens and the weight to divide it by (`jdp.core.weighting.as_sums`; weight
None for a plain mean loss, which is differentiated as it is).
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jdp.core.mesh import device_axes
from jdp.core.options import StepOptions
from jdp.core.weighting import as_sums, check_scalar_loss, is_weighted

AUTO_MASK_ENTRY = "mask"  # mask_key="auto" refuses a plain mean loss beside a batch entry of this name


def batch_rows(batch) -> int:
    """The leading axis shared by every leaf of `batch` (static); one clear error otherwise."""
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("batch has no array leaves; pass a pytree of arrays with a leading batch axis.")
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
    if None in sizes:
        raise ValueError("every batch leaf needs a leading batch axis; found a scalar.")
    if len(sizes) != 1:
        raise ValueError(f"batch leaves disagree on the global batch size: {sorted(sizes)}.")
    return sizes.pop()


def unbound_axes(error: BaseException, bound: str | tuple[str, ...]) -> list[str]:
    """The axis names other than `bound` (a name, or a tuple of them) that the collectives on `error`'s traceback
    were called with.

    jax reports a collective over an axis that is not bound with a bare AssertionError (shard_map)
    or a NameError (pmap) from inside `jax.lax`; the axis it was asked for is in those frames.
    """
    found, tb = [], error.__traceback__
    bound_names = (bound,) if isinstance(bound, str) else tuple(bound)
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.replace("\\", "/").endswith("jax/_src/lax/parallel.py"):
            for name in ("axis_name", "axes"):
                value = frame.f_locals.get(name)
                for axis in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(axis, str) and axis not in bound_names and axis not in found:
                        found.append(axis)
        tb = tb.tb_next
    return found


def _device_axis_hint(batch, error: BaseException) -> str | None:
    """A sentence for a loss that failed on a batch that may still carry a leading device axis, as
    `flax.training.common_utils.shard` makes for `jax.pmap`: (devices, b, ...) on every leaf, so
    that each device sees (1, b, ...)."""
    leaves = jax.tree.leaves(batch)
    if not leaves or not all(jnp.ndim(x) >= 2 and jnp.shape(x)[0] == 1 for x in leaves):
        return None
    first = (str(error).strip().splitlines() or [""])[0]
    return (f"loss_fn failed ({type(error).__name__}{': ' + first if first else ''}) on a per-device batch whose "
            f"every leaf has a leading axis of size 1; if the global batch carries a leading device axis "
            f"(flax.training.common_utils.shard, made for jax.pmap), pass it unsharded, (global batch, ...): "
            f"jdp splits it over the devices.")


def signature_mismatch(loss_fn, names: Sequence[str], needs_rng: bool, rng: str,
                       has_state: bool | None = None) -> str | None:
    """The sentence for a loss whose signature cannot take the arguments `names` its options declare
    (None when it can, or when it has none to read, as a builtin). One argument more without needs_rng
    names needs_rng=True (`rng`: what jdp then passes); has_state: False where the option exists and is
    off (then named too)."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):
        return None

    def binds(n):
        try:
            signature.bind(*range(n))
            return True
        except TypeError:
            return False

    if binds(len(names)):
        return None
    if not needs_rng and binds(len(names) + 1):
        state = ", or has_state=True if it takes the model state before the batch" if has_state is False else ""
        return (f"loss_fn takes {signature}, one argument more than ({', '.join(names)}): pass needs_rng=True if the "
                f"last is a random key (jdp then passes {rng} from the seed, the micro-step and the device){state}.")
    return f"loss_fn must take ({', '.join(names)}); its signature is {signature}."


def call_loss(loss_fn, o: StepOptions, params, model_state, batch, key):
    """Call loss_fn as declared; always returns `(total, (aux, new_model_state, weight))`."""
    try:
        out = loss_fn(params, *((model_state,) if o.has_state else ()), batch, *((key,) if o.needs_rng else ()))
    except (AssertionError, NameError, TypeError, ValueError) as e:
        # AssertionError/NameError: what jax raises for a collective over an axis it does not bind.
        bound = () if o.backend == "jit" else device_axes(o.axis_name, o.replicas)
        unbound = unbound_axes(e, bound) if isinstance(e, (AssertionError, NameError)) else []
        if unbound and o.backend == "jit":
            raise ValueError(f"loss_fn reduces over the mesh axis {unbound[0]!r} (a BatchNorm axis_name or a "
                             f"lax.pmean/psum inside it), but backend='jit' binds no axis: its loss sees the global "
                             f"batch, so drop the axis name (statistics are then over the global batch), or use "
                             f"backend='shard_map'.") from None
        if unbound and o.replicas > 1:
            raise ValueError(f"loss_fn reduces over the mesh axis {unbound[0]!r} (a BatchNorm axis_name or a "
                             f"lax.pmean/psum inside it), but with replicas={o.replicas} (hybrid sharding) the step's "
                             f"devices lie on two axes, {bound}: name both in the model (e.g. BatchNorm "
                             f"axis_name={bound}) to reduce over every device, or use replicas=1.") from None
        if unbound:
            raise ValueError(f"loss_fn reduces over the mesh axis {unbound[0]!r} (a BatchNorm axis_name or a "
                             f"lax.pmean/psum inside it), but the step binds {o.axis_name!r}: pass "
                             f"axis_name={unbound[0]!r} to make_train_step, or name {o.axis_name!r} in the model.") from None
        names = ["params", *(["model_state"] if o.has_state else []), "batch", *(["key"] if o.needs_rng else [])]
        hint = (signature_mismatch(loss_fn, names, o.needs_rng, "a jax.random key", o.has_state)
                if isinstance(e, TypeError) else None) or _device_axis_hint(batch, e)
        if hint is None:
            raise
        raise ValueError(hint) from e
    loss, aux, model_state = _unpack(out, o, model_state)
    check_scalar_loss(loss)
    if not is_weighted(loss) and o.mask_key == "auto" and isinstance(batch, dict) and AUTO_MASK_ENTRY in batch:
        raise ValueError(f"the batch has an entry named {AUTO_MASK_ENTRY!r} and loss_fn returns a plain mean, so jdp "
                         f"cannot tell whether the loss already divides by its weight: pass mask_key="
                         f"{AUTO_MASK_ENTRY!r} if loss_fn returns sum(mask · loss) / b (jdp then divides by the real "
                         f"count), mask_key=None if it is already the mean it should be, or return "
                         f"jdp.Weighted(sum, weight).")
    mask_key = None if o.mask_key == "auto" else o.mask_key
    total, aux, weight = as_sums(loss, aux, batch, mask_key, batch_rows(batch))
    return total, (aux, model_state, weight)


def _unpack(out, o: StepOptions, model_state):
    """(loss, aux, new_model_state) from what loss_fn returned, as its options declare it."""
    if not (o.has_aux or o.has_state):
        return out, {}, model_state
    wanted = ("(loss, (aux, new_model_state))" if o.has_aux and o.has_state
              else "(loss, aux)" if o.has_aux else "(loss, new_model_state)")
    if not (isinstance(out, tuple) and len(out) == 2) or is_weighted(out):
        raise ValueError(f"loss_fn must return {wanted}, got {type(out).__name__}.")
    loss, extras = out
    if o.has_aux and o.has_state and not (isinstance(extras, tuple) and len(extras) == 2):
        raise ValueError(f"loss_fn must return {wanted}.")
    aux, model_state = extras if o.has_aux and o.has_state else (extras, model_state) if o.has_aux else ({}, extras)
    for path, leaf in jax.tree_util.tree_leaves_with_path(aux, is_leaf=is_weighted):
        shapes = [jnp.shape(x) for x in (leaf if is_weighted(leaf) else (leaf,)) if jnp.ndim(x)]
        if shapes:  # averaged over devices, a per-example value would come back as garbage
            raise ValueError(f"aux{jax.tree_util.keystr(path)} has shape {shapes[0]}; aux must hold scalars "
                             f"that are means over the examples (such as accuracy), which jdp averages over "
                             f"devices, or jdp.Weighted(sum, weight) of scalars: return per-example values such "
                             f"as logits from a separate function.")
    return loss, aux, model_state
