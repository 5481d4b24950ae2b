"""Optimizer specs: typed values that build optax chains, and what a psum reduction does to them.

A spec names every hyperparameter whose meaning depends on the gradient's scale, so that
`exact_sum_spec` can say precisely which ones must change when gradients are summed over N
devices instead of averaged (Adam's ε, the clipping threshold, SGD's learning rate), and carries
its learning-rate schedule, so that one `build()` makes every optax chain jdp runs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import optax

from jdp.core.options import LR_CORRECTIONS, OptionError, _is_int

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer as data: `build()` turns it into an optax chain (clip -> optimizer, lr schedule inside).

    Invalid values raise `jdp.core.options.OptionError` (a ValueError) whose `field` names the field.
    """

    name: str = "adam"  # one of OPTIMIZERS
    lr: float = 1e-3  # learning rate (peak value when a schedule is used)
    momentum: float = 0.9  # "momentum" only: the heavy-ball coefficient
    b1: float = 0.9  # adam/adamw: first-moment decay
    b2: float = 0.999  # adam/adamw: second-moment decay
    eps: float = 1e-8  # adam/adamw: added to sqrt(v); NOT scale-free in the gradient
    weight_decay: float = 0.0  # adamw: decoupled decay, multiplied by lr, independent of the gradient
    clip_norm: float | None = None  # clip the gradient's global norm to this value first (None: off)
    schedule: str = "constant"  # after warmup: one of SCHEDULES; cosine and linear reach 0 at decay_steps
    warmup_steps: int = 0  # optimizer steps of linear warmup from 0 to lr
    decay_steps: int | None = None  # cosine/linear only (and required there): the optimizer step where lr hits 0

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise OptionError("name", f"optimizer name={self.name!r} is not supported; use one of {OPTIMIZERS}.")
        for field in ("lr", "eps"):
            if not getattr(self, field) > 0:
                raise OptionError(field, f"{field}={getattr(self, field)} must be positive.")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise OptionError("clip_norm", f"clip_norm={self.clip_norm} must be positive, or None to turn "
                              f"clipping off.")
        if self.weight_decay < 0:
            raise OptionError("weight_decay", f"weight_decay={self.weight_decay} must be non-negative.")
        if self.weight_decay and self.name != "adamw":
            raise OptionError("weight_decay", f"weight_decay={self.weight_decay} needs name='adamw' (decoupled "
                              f"decay); got name={self.name!r}.")
        self._check_schedule()

    def _check_schedule(self) -> None:
        if self.schedule not in SCHEDULES:
            raise OptionError("schedule", f"schedule={self.schedule!r} is not supported; use one of {SCHEDULES}.")
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise OptionError("warmup_steps", f"warmup_steps={self.warmup_steps!r} must be an integer of at "
                              f"least 0.")
        if self.schedule == "constant":
            if self.decay_steps is not None:
                raise OptionError("decay_steps", f"decay_steps={self.decay_steps!r} needs schedule 'cosine' or "
                                  f"'linear'; a constant schedule never decays (use None).")
            return
        if not _is_int(self.decay_steps) or self.decay_steps < 1:
            raise OptionError("decay_steps", f"decay_steps={self.decay_steps!r} must be a positive integer, the "
                              f"optimizer step at which schedule={self.schedule!r} reaches 0.")
        if self.warmup_steps >= self.decay_steps:
            raise OptionError("warmup_steps", f"warmup_steps={self.warmup_steps} must be less than decay_steps="
                              f"{self.decay_steps}, since schedule={self.schedule!r} decays to 0 at decay_steps.")

    def lr_schedule(self) -> float | optax.Schedule:
        """What optax is given as its learning rate: the float `lr` for a constant schedule without
        warmup, else the optax schedule of the optimizer step (0-based count of updates applied).

        Linear warmup from 0 at step 0 to `lr` at step warmup_steps, then constant, or cosine or
        linear decay to 0 at step decay_steps.
        """
        w, peak = self.warmup_steps, self.lr
        if self.schedule == "cosine":
            return optax.warmup_cosine_decay_schedule(0.0, peak, w, self.decay_steps, end_value=0.0)
        if self.schedule == "constant":
            if w == 0:
                return peak
            after = optax.constant_schedule(peak)
        else:
            after = optax.linear_schedule(peak, 0.0, self.decay_steps - w)
        return after if w == 0 else optax.join_schedules([optax.linear_schedule(0.0, peak, w), after], [w])

    def learning_rate(self, step: int) -> float:
        """The learning rate of the update after `step` optimizer steps, as this spec states it (for logging)."""
        lr = self.lr_schedule()
        return float(lr(step)) if callable(lr) else float(lr)

    def build(self) -> optax.GradientTransformation:
        """The optax chain: `optax.clip_by_global_norm` (if set), then the optimizer with `lr_schedule()`.

        The sharded layouts run it as written, on the whole gradient's norm (`jdp.core.blockwise`).
        """
        lr = self.lr_schedule()
        if self.name == "sgd":
            opt = optax.sgd(lr)
        elif self.name == "momentum":
            opt = optax.sgd(lr, momentum=self.momentum)
        elif self.name == "adam":
            opt = optax.adam(lr, b1=self.b1, b2=self.b2, eps=self.eps)
        else:
            opt = optax.adamw(lr, b1=self.b1, b2=self.b2, eps=self.eps, weight_decay=self.weight_decay)
        if self.clip_norm is None:
            return opt
        return optax.chain(optax.clip_by_global_norm(self.clip_norm), opt)

    def replace(self, **changes) -> OptimizerSpec:
        """A copy with `changes` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def exact_sum_spec(spec: OptimizerSpec, num_devices: int) -> OptimizerSpec:
    """The spec that, fed the psum of gradients (N× the mean), takes exactly the mean-reduced step.

    Each change undoes the N× in the one place the gradient's scale is seen:
      - clipping: max-norm × N (the summed gradient's norm is N×);
      - sgd, momentum: lr ÷ N (the update is linear in the gradient; a schedule's peak, so every step's lr);
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


def check_optimizer(optimizer, params, accum_steps: int) -> None:
    """Refuse, in one sentence, an optax optimizer the step cannot drive as given (`params`: the
    params it will update; only shapes are used).

    An optimizer already inside `optax.MultiSteps` accumulates on its own, so with accum_steps > 1
    each update would cover accum_steps × its k micro-batches while the step reports updates at
    every accum_steps-th call. An optimizer whose update needs extra arguments
    (`optax.contrib.reduce_on_plateau` needs `value=loss`) would fail inside optax: the step calls
    `update(updates, state, params)` only.
    """
    if isinstance(optimizer, OptimizerSpec):
        return
    import jax

    state = jax.eval_shape(optimizer.init, params)
    wrapped = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.MultiStepsState))
               if isinstance(x, optax.MultiStepsState)]
    if wrapped and accum_steps > 1:
        raise ValueError(f"the optimizer is an optax.MultiSteps, which accumulates micro-batches itself, and "
                         f"accum_steps={accum_steps} accumulates too, so each update would cover accum_steps × "
                         f"MultiSteps' k micro-batches while the step reports one every {accum_steps} calls; "
                         f"accumulate once: pass the optimizer MultiSteps wraps with accum_steps=k, or keep "
                         f"MultiSteps with accum_steps=1.")
    try:
        jax.eval_shape(optimizer.update, params, state, params)
    except TypeError as e:
        if "required" not in str(e) or "argument" not in str(e):
            raise
        raise ValueError(f"the optimizer's update needs arguments besides (updates, state, params) ({e}), such as "
                         f"optax.contrib.reduce_on_plateau's value=loss, which the step does not pass; use a "
                         f"learning-rate schedule (OptimizerSpec.schedule, or an optax schedule as the learning "
                         f"rate) instead.") from None


def for_reduction(optimizer: optax.GradientTransformation | OptimizerSpec, lr_correction: str,
                  num_devices: int) -> optax.GradientTransformation:
    """The transformation that consumes a gradient reduced over `num_devices`, with the psum correction applied.

    `lr_correction` (resolved; see `jdp.core.options.StepOptions`): "none" builds `optimizer` as it is;
    "auto" scales every update by 1/N; "exact" builds `exact_sum_spec(optimizer, N)`, which needs
    an `OptimizerSpec`.
    """
    if lr_correction not in LR_CORRECTIONS:
        raise ValueError(f"lr_correction={lr_correction!r} is not supported; use one of {LR_CORRECTIONS}.")
    if lr_correction == "exact":
        if not isinstance(optimizer, OptimizerSpec):
            raise ValueError("lr_correction='exact' needs a jdp.OptimizerSpec (it changes the spec's "
                             "scale-dependent hyperparameters), not a bare optax transformation.")
        return exact_sum_spec(optimizer, num_devices).build()
    tx = optimizer.build() if isinstance(optimizer, OptimizerSpec) else optimizer
    if lr_correction == "auto":
        # Every optax update is linear in the learning rate, so scaling the update by 1/N is
        # lr/N for any optimizer: exact for SGD and momentum, wrong for Adam (see jdp explain).
        return optax.chain(tx, optax.scale(1.0 / num_devices))
    return tx


def with_grad_scale(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`tx` that first multiplies the gradient it is given by `grad_scale`, an extra argument of its
    update (None: unchanged); its state is `tx`'s own.

    Inside optax.MultiSteps (accum_sync="every") this divides a weighted loss's running mean of
    gradient sums by the optimizer step's whole weight, known only on the step's last call.
    """
    takes_extra = isinstance(tx, optax.GradientTransformationExtraArgs)

    def update(updates, state, params=None, *, grad_scale=None, **extra):
        if grad_scale is not None:
            updates = optax.tree.cast_like(optax.tree.scale(grad_scale, updates), updates)
        return tx.update(updates, state, params, **extra) if takes_extra else tx.update(updates, state, params)

    return optax.GradientTransformationExtraArgs(tx.init, update)
