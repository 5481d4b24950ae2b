"""Turn an `nnx.Module` into pure functions over a params pytree (split once, merge per call)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flax import nnx


@dataclass(frozen=True)
class FunctionalModel:
    """A module split into its static graph, its `nnx.Param` leaves and everything else."""

    graphdef: Any
    params: Any  # nnx.State of the nnx.Param variables: the pytree jdp differentiates and updates
    rest: Any  # non-parameter state (e.g. BatchNorm statistics, RNG counters)

    def apply(self, params, *args, **kwargs):
        """Call the module with `params` in place of its own parameters."""
        # copy=True: merging must not alias the caller's arrays (required by Flax 0.12).
        model = nnx.merge(self.graphdef, params, self.rest, copy=True)
        return model(*args, **kwargs)


def functional(model: nnx.Module) -> FunctionalModel:
    """Split `model` into `(graphdef, params, rest)` for pure-function training."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return FunctionalModel(graphdef, params, rest)
