"""Turn an `nnx.Module` into pure functions over a params pytree (split once, merge per call)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flax import nnx


def apply_with_state(graphdef, params, rest, *args, **kwargs):
    """Call the module `nnx.merge(graphdef, params, rest)` on `args`; return `(output, new_rest)`.

    `new_rest` holds the non-parameter variables as the call left them (BatchNorm running
    averages after a train-mode call), in the structure of `rest`. Pure: the inputs are not
    modified (`copy=True` merges a private copy, as Flax 0.12 requires).
    """
    return apply_method_with_state(graphdef, params, rest, "__call__", *args, **kwargs)


def apply_method_with_state(graphdef, params, rest, method: str, *args, **kwargs):
    """`apply_with_state` calling the module's method named `method` (e.g. the GPT's "token_losses")."""
    model = nnx.merge(graphdef, params, rest, copy=True)
    out = getattr(model, method)(*args, **kwargs)
    _, _, new_rest = nnx.split(model, nnx.Param, ...)
    return out, new_rest


@dataclass(frozen=True)
class FunctionalModel:
    """A module split into its static graph, its `nnx.Param` leaves and everything else."""

    graphdef: Any
    params: Any  # nnx.State of the nnx.Param variables: the pytree jdp differentiates and updates
    rest: Any  # non-parameter state (e.g. BatchNorm statistics): jdp's `model_state`

    def apply(self, params, *args, **kwargs):
        """Call the module with `params` and the split-time `rest`; returns only the output."""
        return apply_with_state(self.graphdef, params, self.rest, *args, **kwargs)[0]

    def apply_with_state(self, params, rest, *args, **kwargs):
        """Call the module with `params` and `rest`; returns `(output, new_rest)`."""
        return apply_with_state(self.graphdef, params, rest, *args, **kwargs)

    def apply_method_with_state(self, params, rest, method: str, *args, **kwargs):
        """Call the module's method `method` with `params` and `rest`; returns `(output, new_rest)`."""
        return apply_method_with_state(self.graphdef, params, rest, method, *args, **kwargs)


def functional(model: nnx.Module) -> FunctionalModel:
    """Split `model` into `(graphdef, params, rest)` for pure-function training."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return FunctionalModel(graphdef, params, rest)
