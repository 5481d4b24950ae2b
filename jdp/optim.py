"""Optimizer specs: typed values that build optax chains, and what a psum reduction does to them.

A spec names every hyperparameter whose meaning depends on the gradient's scale, so that
`exact_sum_spec` can say precisely which ones must change when gradients are summed over N
devices instead of averaged (seed 000: Adam's ε, the clipping threshold, SGD's learning rate).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import optax

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer as data: `build()` turns it into an optax chain (clip -> optimizer)."""

    name: str = "adam"  # one of OPTIMIZERS
    lr: float = 1e-3  # learning rate (peak value when a schedule is used)
    momentum: float = 0.9  # "momentum" only: the heavy-ball coefficient
    b1: float = 0.9  # adam/adamw: first-moment decay
    b2: float = 0.999  # adam/adamw: second-moment decay
    eps: float = 1e-8  # adam/adamw: added to sqrt(v); NOT scale-free in the gradient
    weight_decay: float = 0.0  # adamw: decoupled decay, multiplied by lr, independent of the gradient
    clip_norm: float | None = None  # clip the gradient's global norm to this value first (None: off)

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer name={self.name!r} is not supported; use one of {OPTIMIZERS}.")
        for field in ("lr", "eps"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field}={getattr(self, field)} must be positive.")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm={self.clip_norm} must be positive, or None to turn clipping off.")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be non-negative.")
        if self.weight_decay and self.name != "adamw":
            raise ValueError(f"weight_decay={self.weight_decay} needs name='adamw' (decoupled decay); "
                             f"got name={self.name!r}.")

    def build(self) -> optax.GradientTransformation:
        """The optax chain: `clip_by_global_norm` (if set), then the optimizer."""
        if self.name == "sgd":
            opt = optax.sgd(self.lr)
        elif self.name == "momentum":
            opt = optax.sgd(self.lr, momentum=self.momentum)
        elif self.name == "adam":
            opt = optax.adam(self.lr, b1=self.b1, b2=self.b2, eps=self.eps)
        else:
            opt = optax.adamw(self.lr, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay)
        if self.clip_norm is None:
            return opt
        return optax.chain(optax.clip_by_global_norm(self.clip_norm), opt)

    def replace(self, **changes) -> OptimizerSpec:
        return dataclasses.replace(self, **changes)


def exact_sum_spec(spec: OptimizerSpec, num_devices: int) -> OptimizerSpec:
    """The spec that, fed the psum of gradients (N× the mean), takes exactly the mean-reduced step.

    Each change undoes the N× in the one place the gradient's scale is seen:
      - clipping: max-norm × N (the summed gradient's norm is N×);
      - sgd, momentum: lr ÷ N (the update is linear in the gradient);
      - adam, adamw: ε × N, lr unchanged (m/√v is scale-free except for ε);
      - adamw weight decay: unchanged (it multiplies the params, not the gradient).
    """
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices} must be at least 1.")
    n = num_devices
    changes = {}
    if spec.clip_norm is not None:
        changes["clip_norm"] = spec.clip_norm * n
    if spec.name in ("sgd", "momentum"):
        changes["lr"] = spec.lr / n
    else:
        changes["eps"] = spec.eps * n
    return spec.replace(**changes)
