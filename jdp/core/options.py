"""The step's options as one frozen, validated value: every rule about them lives here, once.

`make_train_step` builds a `StepOptions` from its keyword arguments; `jdp.config.validate` builds
one from a config's `parallel` and `train` sections and puts the dotted key in front of the message.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jdp.core.mesh import REPLICA_AXIS, SHARD_AXIS
from jdp.core.precision import dtype_name

BACKENDS = ("shard_map", "pmap", "jit")
REDUCTIONS = ("mean", "sum")
LR_CORRECTIONS = ("auto", "none", "exact")
ACCUM_SYNCS = ("every", "last")


class OptionError(ValueError):
    """A step option that cannot run; `field` names it (e.g. "lr_correction")."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True)
class StepOptions:
    """How `make_train_step` spreads, reduces and accumulates; see its docstring for each field."""

    backend: str = "shard_map"  # one of BACKENDS
    reduction: str = "mean"  # one of REDUCTIONS
    lr_correction: str | None = None  # reduction="sum" only; resolved to "none" (mean) or "auto" (sum, None)
    accum_steps: int = 1  # M micro-batches per optimizer step
    accum_sync: str = "every"  # one of ACCUM_SYNCS; matters only when accum_steps > 1
    has_aux: bool = False
    needs_rng: bool = False
    has_state: bool = False
    mask_key: str | None = "auto"  # "auto": no mask, and a plain loss beside a "mask" entry is refused
    skip_nonfinite: bool = False
    grad_norm: bool = True
    precision: str = "float32"  # compute dtype of forward and backward: "float32" or "bfloat16"
    reduce_dtype: str | None = None  # dtype the gradient is all-reduced in; None: the gradient's own
    shard_optimizer_state: bool = False  # ZeRO-1: each device keeps 1/N of the optimizer state
    axis_name: str = "data"  # the mesh axis the step binds; code that reduces over "batch" passes "batch"
    sync_batchnorm: bool = True  # model state out of the loss must agree on every device (checked)
    shard_params: bool = False  # FSDP: 1/N of the params too; implies shard_optimizer_state
    gather_in_model: bool = False  # shard_params: the model gathers its params itself (`jdp.fsdp.gather`), per layer
    replicas: int = 1  # hybrid sharding: the sharded state split within each of this many device groups
    axis_rules: tuple = ()  # backend="jit": (annotation name, jdp mesh axis or None) pairs (`jdp.core.annotations`)
    audit: bool = True  # the first call checks that a plain loss is a mean over its rows (`jdp.core.audit`)

    def __post_init__(self):
        for field, choices in (("backend", BACKENDS), ("reduction", REDUCTIONS), ("accum_sync", ACCUM_SYNCS)):
            if getattr(self, field) not in choices:
                raise OptionError(field, f"{field}={getattr(self, field)!r} is not supported; use one of {choices}.")
        for field in ("accum_steps", "replicas"):
            if not _is_int(getattr(self, field)) or getattr(self, field) < 1:
                raise OptionError(field, f"{field}={getattr(self, field)!r} must be an integer of at least 1.")
        for field in ("has_aux", "needs_rng", "has_state", "skip_nonfinite", "grad_norm", "shard_optimizer_state",
                      "sync_batchnorm", "shard_params", "gather_in_model", "audit"):
            if not isinstance(getattr(self, field), (bool, np.bool_)):
                raise OptionError(field, f"{field}={getattr(self, field)!r} must be True or False.")
        if self.shard_params and self.backend == "pmap":
            raise OptionError("shard_params", f"shard_params=True needs backend='shard_map' or 'jit' (got "
                              f"{self.backend!r}): pmap keeps a whole copy of the params on every device.")
        if self.gather_in_model and not self.shard_params:
            raise OptionError("gather_in_model", "gather_in_model=True needs shard_params=True: only split params "
                              "are handed to the model to gather.")
        if self.shard_params:  # the params' slices are updated by the optimizer state's slices
            object.__setattr__(self, "shard_optimizer_state", True)
        if self.shard_optimizer_state and self.backend == "pmap":
            raise OptionError("shard_optimizer_state", f"shard_optimizer_state=True needs backend='shard_map' or "
                              f"'jit' (got {self.backend!r}): pmap keeps a whole copy of the state on every device.")
        if self.replicas > 1 and not self.shard_optimizer_state:
            raise OptionError("replicas", f"replicas={self.replicas} (hybrid sharding) splits the sharded state within "
                              f"groups of devices; it needs shard_params=True or shard_optimizer_state=True (without "
                              f"them every device holds the whole state already).")
        if self.replicas > 1 and self.axis_name in (REPLICA_AXIS, SHARD_AXIS):
            raise OptionError("axis_name", f"axis_name={self.axis_name!r} is one of hybrid sharding's two mesh axes "
                              f"({REPLICA_AXIS!r}, {SHARD_AXIS!r}); use another name with replicas={self.replicas}.")
        if not isinstance(self.axis_name, str) or not self.axis_name.isidentifier():
            raise OptionError("axis_name", f"axis_name={self.axis_name!r} must be a mesh axis name: a non-empty "
                              f"identifier such as 'data' or 'batch'.")
        if self.mask_key is not None and not isinstance(self.mask_key, str):
            raise OptionError("mask_key", f"mask_key={self.mask_key!r} must be a string or None.")
        for field, allow_none in (("precision", False), ("reduce_dtype", True)):
            try:
                object.__setattr__(self, field, dtype_name(getattr(self, field), field, allow_none))
            except ValueError as e:
                raise OptionError(field, str(e)) from None
        if self.gather_in_model and self.reduce_dtype is not None:
            raise OptionError("gather_in_model", f"gather_in_model=True reduce-scatters each layer's gradient in the "
                              f"backward pass, in the params' dtype, so reduce_dtype={self.reduce_dtype!r} cannot "
                              f"apply; use reduce_dtype=None.")
        self._check_axis_rules()
        if self.backend == "jit":
            self._check_global_view()
        object.__setattr__(self, "accum_steps", int(self.accum_steps))
        object.__setattr__(self, "replicas", int(self.replicas))
        object.__setattr__(self, "lr_correction", self._resolved_lr_correction())

    def _check_axis_rules(self) -> None:
        """axis_rules: a dict (or pairs) from a sharding annotation's axis names to jdp's mesh axes or None."""
        rules = self.axis_rules
        if rules is None:
            rules = ()
        if isinstance(rules, dict):
            rules = tuple(rules.items())
        axes = (REPLICA_AXIS, SHARD_AXIS) if self.replicas > 1 else (self.axis_name,)
        if not isinstance(rules, (tuple, list)) or not all(isinstance(r, (tuple, list)) and len(r) == 2 for r in rules):
            raise OptionError("axis_rules", f"axis_rules={self.axis_rules!r} must be a dict from the annotations' "
                              f"axis names to one of jdp's mesh axes {axes} or None.")
        for name, axis in rules:
            if not isinstance(name, str) or not (axis is None or axis in axes):
                raise OptionError("axis_rules", f"axis_rules maps {name!r} to {axis!r}; map a sharding annotation's "
                                  f"axis name (a string) to one of jdp's mesh axes {axes} or to None (replicated).")
        if rules and self.backend != "jit":
            raise OptionError("axis_rules", f"axis_rules maps the params' sharding annotations onto the mesh, which "
                              f"only backend='jit' honours; backend={self.backend!r} keeps whole params on every "
                              f"device (drop axis_rules, or use backend='jit').")
        object.__setattr__(self, "axis_rules", tuple((name, axis) for name, axis in rules))

    def _check_global_view(self) -> None:
        """Refuse what backend="jit" cannot mean: it runs one program on the global batch, and the
        partitioner, not jdp, places the gradient's all-reduce (`jdp.core.global_view`)."""
        why = "`jdp explain` shows what the per-device step would do"
        if self.reduction != "mean":
            raise OptionError("reduction", f"reduction={self.reduction!r} sums per-device gradients, and "
                              f"backend='jit' has none (its loss and gradient are the global batch's already); use "
                              f"reduction='mean', or backend='shard_map' for the psum variant ({why}).")
        if self.lr_correction not in (None, "none"):
            raise OptionError("lr_correction", f"lr_correction={self.lr_correction!r} corrects a per-device sum, "
                              f"and backend='jit' has none; use lr_correction=None, or backend='shard_map' ({why}).")
        if self.accum_steps > 1 and self.accum_sync == "last":
            raise OptionError("accum_sync", "accum_sync='last' needs per-device gradient sums, and under "
                              "backend='jit' every call's gradient is all-reduced by the partitioner; use "
                              "accum_sync='every' or backend='shard_map'.")
        if self.reduce_dtype is not None:
            raise OptionError("reduce_dtype", f"reduce_dtype={self.reduce_dtype!r} cannot apply under "
                              f"backend='jit': the partitioner all-reduces the gradient inside the backward pass, in "
                              f"the dtype it is computed in (precision); use reduce_dtype=None, or "
                              f"backend='shard_map'.")
        if self.gather_in_model:
            raise OptionError("gather_in_model", "gather_in_model=True cannot apply under backend='jit': the "
                              "partitioner gathers the split params itself; use gather_in_model=False.")
        if not self.sync_batchnorm:
            raise OptionError("sync_batchnorm", "sync_batchnorm=False accepts per-device statistics, and under "
                              "backend='jit' the loss sees the global batch, so its statistics are always the "
                              "global batch's; use sync_batchnorm=True.")

    def _resolved_lr_correction(self) -> str:
        if self.reduction == "mean":
            if self.lr_correction not in (None, "none"):
                raise OptionError("lr_correction", f"lr_correction={self.lr_correction!r} only applies to "
                                  f"reduction='sum'; the mean reduction already yields the global-batch gradient "
                                  f"(use None or 'none').")
            return "none"
        if self.lr_correction is None:
            return "auto"
        if self.lr_correction not in LR_CORRECTIONS:
            raise OptionError("lr_correction", f"lr_correction={self.lr_correction!r} is not supported; "
                              f"use one of {LR_CORRECTIONS}.")
        return self.lr_correction

    @property
    def local_accum(self) -> bool:
        """accum_sync="last" with M > 1: per-device sums, one all-reduce per optimizer step."""
        return self.accum_steps > 1 and self.accum_sync == "last"

    @property
    def multi_steps(self) -> bool:
        """accum_sync="every" with M > 1: optax.MultiSteps averages the M reduced gradients."""
        return self.accum_steps > 1 and self.accum_sync == "every"
