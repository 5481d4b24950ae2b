"""What a step keeps on each device: params, gradient, optimizer state, accumulator, in bytes."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np


def bytes_on_one_device(tree) -> int:
    """Bytes of `tree`'s arrays held by the first device: a replicated leaf counts whole, a sharded
    one by its shard (and a pmap-stacked one by its one copy)."""
    return int(sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)))


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per device of one step's state, read from the arrays' shards (and XLA's analysis)."""

    devices: int
    sharded: bool  # shard_optimizer_state (also true with shard_params)
    params: int  # between steps: whole, or this device's blocks (shard_params)
    gradient: int  # the whole gradient's bytes: what the backward pass makes on every device, except
    #                under per-layer gathering (gather_in_model), where each layer's is reduce-scattered
    #                as it is made and no device holds it whole (`allocated` is the peak there)
    reduced_gradient: int  # after the reduction: the whole gradient, or this device's blocks
    optimizer_state: int
    accumulator: int  # accum_sync="last": this device's gradient sums; "every": a few scalars
    compiled: dict | None = None  # XLA's memory analysis of the compiled step, bytes per device
    params_sharded: bool = False  # shard_params: the params are kept split between steps
    gathered: str | None = None  # shard_params: "whole model" (before the loss) or "per layer, by the model"
    replicas: int = 1  # hybrid sharding: the sharded state is split within each of this many device groups
    whole: tuple = ()  # sharded layouts: (path, bytes) of the params leaves kept whole on every device

    @property
    def state(self) -> int:
        """Bytes of the state the step keeps between calls."""
        return self.params + self.optimizer_state + self.accumulator

    @property
    def allocated(self) -> int | None:
        """The most bytes the compiled step holds on a device (with a batch): its arguments, its
        outputs not aliased to donated arguments, and its temporaries (XLA's buffer assignment
        reuses temporary space by liveness, so `temp` is already the temporaries' peak)."""
        if not self.compiled:
            return None
        c = self.compiled
        return c["argument"] + c["output"] - c["alias"] + c["temp"]

    @property
    def layout(self) -> str:
        """The layout in words: replicated, ZeRO-1 or FSDP, how FSDP gathers the params, and the
        replica groups of hybrid sharding."""
        groups = (f" over {self.devices // self.replicas} devices in each of {self.replicas} replica groups"
                  if self.replicas > 1 else "")
        return (f"params, gradient and optimizer state sharded{groups}, gathered {self.gathered}" if self.params_sharded
                else f"optimizer state sharded{groups}" if self.sharded else "replicated")

    def whole_text(self, shown: int = 3) -> str:
        """The params leaves a sharded layout keeps whole on every device (with their optimizer state)
        in words, the `shown` largest named with their bytes; "" when there are none."""
        if not self.whole:
            return ""
        n, group = len(self.whole), self.devices // self.replicas
        named = ", ".join(f"{path} {size:,} B" for path, size in self.whole[:shown])
        more = f" and {n - shown} more" if n > shown else ""
        leaves, its, it = ("params leaf stays", "its", "it") if n == 1 else ("params leaves stay", "their", "theirs")
        return (f"{n} {leaves} whole on every device with {its} optimizer state, {sum(b for _, b in self.whole):,} B, "
                f"as no dimension of {it} divides by {group}: {named}{more}")

    def __str__(self) -> str:
        layout = self.layout
        text = (f"{self.devices} device(s), {layout}: per device params {self.params:,} B, gradient "
                f"{self.gradient:,} B (reduced: {self.reduced_gradient:,} B), optimizer state "
                f"{self.optimizer_state:,} B, accumulator {self.accumulator:,} B")
        if self.compiled:
            text += (", compiled step: " + ", ".join(f"{k} {v:,} B" for k, v in self.compiled.items())
                     + f" (allocates {self.allocated:,} B)")
        if self.whole:
            text += f"; {self.whole_text()}"
        return text


def memory_report(step, state, batch=None) -> MemoryReport:
    """Bytes per device of `state` (from `step.init`) for `step`; with `batch`, also XLA's memory
    analysis of the compiled step: arguments, outputs, the bytes of outputs aliased to donated
    arguments, temporaries, and `peak` (XLA's own peak estimate; on CPU it leaves the
    temporaries out, so `MemoryReport.allocated` is the figure to compare there)."""
    cuts = getattr(step.layout, "cuts", None)  # a sharded layout's: the params' own shapes and splits
    shapes = (cuts.leaves if cuts is not None else
              [jax.ShapeDtypeStruct(np.shape(x)[1:] if state.stacked else np.shape(x), x.dtype)
               for x in jax.tree.leaves(state.params)])
    floating = [i for i, x in enumerate(shapes) if np.issubdtype(x.dtype, np.inexact)]
    float_bytes = int(sum(np.prod(shapes[i].shape, dtype=np.int64) * shapes[i].dtype.itemsize for i in floating))
    reduced = float_bytes if cuts is None else int(sum(cuts.block_bytes(i) for i in floating))
    compiled = None
    if batch is not None:
        stats = step.lower(state, batch).compile().memory_analysis()
        compiled = None if stats is None else {name: int(getattr(stats, f"{name}_size_in_bytes"))
                                               for name in ("argument", "output", "alias", "temp")}
        if compiled is not None:
            compiled["peak"] = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    return MemoryReport(devices=step.num_devices, sharded=cuts is not None, params=bytes_on_one_device(state.params),
                        gradient=float_bytes, reduced_gradient=reduced,
                        optimizer_state=bytes_on_one_device(state.opt_state),
                        accumulator=bytes_on_one_device(state.accum), compiled=compiled,
                        params_sharded=bool(step.options.shard_params),
                        gathered=None if not step.options.shard_params else
                        "by the partitioner (backend='jit')" if step.options.backend == "jit" else
                        "per layer, by the model (gather_in_model)" if step.options.gather_in_model else
                        "whole model, before the loss", replicas=step.options.replicas,
                        whole=() if cuts is None else tuple(cuts.whole_leaves()))
