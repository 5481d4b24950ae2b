"""Weighted losses: a sum over examples or tokens, and the weight it is a sum over.

A language model's loss is a mean over real tokens, and the count of real tokens differs between
rows, devices and micro-batches. Dividing on each device (or each micro-batch) by its own count and
then averaging gives a mean of means, not the mean over the global batch. jdp's contract is exact
when the loss hands it the sum and the weight instead:

    return jdp.Weighted(jnp.sum(mask * per_token_loss), jnp.sum(mask))

Every device returns its sum and weight; jdp sums both over the N devices and the M micro-batches
of the optimizer step and divides once, so the gradient is the gradient of
    Σ_all tokens w·l / Σ_all tokens w,
the loss one device computes on the whole global batch, whatever the token counts.

Inside the step every loss travels in this form (`as_sums`): a plain mean loss is its own "sum",
with no weight (weight None: nothing to divide, the step is as it always was); a loss under
`mask_key` (`sum(mask · l) / b`) is the sum `b · loss` over the weight `sum(mask)`.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Weighted(NamedTuple):
    """A sum over examples or tokens (`total`) and the sum of their weights (`weight`, ≥ 0).

    As a loss (or an aux value) on one device: scalars, e.g. `Weighted(jnp.sum(mask * nll),
    jnp.sum(mask))`; jdp reports and differentiates `Σ total / Σ weight` over all devices and
    micro-batches. As an evaluation metric: arrays with a leading batch axis, (b,) or (b, L).
    """

    total: Any
    weight: Any


def is_weighted(x) -> bool:
    return isinstance(x, Weighted)


def check_scalar_loss(loss, where: str = "loss_fn") -> None:
    """Refuse, in one sentence, a loss that is not a scalar (or a Weighted of two scalars)."""
    if is_weighted(loss):
        for name, value in (("total", loss.total), ("weight", loss.weight)):
            if jnp.ndim(value):
                raise ValueError(f"{where} returned jdp.Weighted with {name} of shape {jnp.shape(value)}; both fields "
                                 f"must be scalars: the sum over this device's examples or tokens (total), and the "
                                 f"sum of their weights (weight), e.g. jnp.sum(mask * loss) and jnp.sum(mask).")
        return
    if isinstance(loss, tuple):
        raise ValueError(f"{where} returned a tuple of {len(loss)} values where the step expects the loss alone; "
                         f"a loss that returns (loss, aux) needs has_aux=True (and (loss, new_model_state) "
                         f"has_state=True).")
    if jnp.ndim(loss):
        raise ValueError(f"{where} returned a loss of shape {jnp.shape(loss)}; the step differentiates a scalar: the "
                         f"mean over the examples given, or jdp.Weighted(sum, weight) for a weighted mean.")


def as_sums(loss, aux, batch, mask_key: str | None, rows: int):
    """`(total, aux, weight)`: the loss as a sum over this device's examples with its weight.

    - `Weighted(total, weight)`: as given; plain aux scalars become `Weighted(a · weight, weight)`
      (read as means over the same tokens; 0 where the weight is 0, whose mean is 0/0: a device
      of padding only adds nothing), Weighted aux stay.
    - under `mask_key` (loss = `sum(mask · l) / b`): total `b · loss`, weight `sum(mask)`; aux the same.
    - a plain mean: `(loss, aux, None)`: nothing to divide by.
    """
    if is_weighted(loss):
        weight = jnp.asarray(loss.weight, jnp.float32)
        return loss.total, weighted_aux(aux, lambda a: Weighted(_times(a, weight), weight)), weight
    if mask_key is not None and isinstance(batch, dict) and mask_key in batch:
        weight = jnp.sum(batch[mask_key], dtype=jnp.float32)
        return loss * rows, weighted_aux(aux, lambda a: Weighted(a * rows, weight)), weight
    for path, leaf in jax.tree_util.tree_leaves_with_path(aux, is_leaf=is_weighted):
        if is_weighted(leaf):
            raise ValueError(f"aux{jax.tree_util.keystr(path)} is a jdp.Weighted but the loss is a plain mean; return "
                             f"the loss as jdp.Weighted(sum, weight) too, or aux{jax.tree_util.keystr(path)} as a mean.")
    return loss, aux, None


def _times(mean, weight):
    """`mean · weight`, 0 where `weight` is 0 (a mean over no tokens is 0/0 = NaN, and NaN · 0 is NaN)."""
    return jnp.where(weight == 0, jnp.zeros_like(mean * weight), mean * weight)


def weighted_aux(aux, wrap):
    """`aux` with every plain leaf wrapped by `wrap`; Weighted leaves as they are (weights in float32)."""
    def one(leaf):
        if is_weighted(leaf):
            return Weighted(leaf.total, jnp.asarray(leaf.weight, jnp.float32))
        return wrap(leaf)
    return jax.tree.map(one, aux, is_leaf=is_weighted)


def ratios(tree):
    """Every `Weighted(total, weight)` in `tree` as `total / weight`, in float32."""
    return jax.tree.map(lambda w: (w.total / w.weight).astype(jnp.float32) if is_weighted(w) else w, tree,
                        is_leaf=is_weighted)


def divided(tree, weight):
    """`tree / weight`, each leaf keeping its dtype: a gradient of sums made a gradient of the mean."""
    return jax.tree.map(lambda x: (x / weight).astype(x.dtype), tree)
