"""What a step settles on its first call: the accumulator's aux sized, the returned model state checked, the loss audited."""
from __future__ import annotations

from collections.abc import Callable

import jax

from jdp.core.audit import Audit, AuditError, audit_loss
from jdp.core.layouts import UNSIZED
from jdp.core.mesh import data_axes
from jdp.core.model_state import check_agreement, check_structure, spread_over_devices
from jdp.core.options import StepOptions
from jdp.core.state import TrainState


class FirstCall:
    """What the step settles on its first call, once aux's and the model state's structures are known:
    the accumulator's aux sums sized, and the model state the loss hands back checked."""

    def __init__(self, layout, mesh, declared_loss: Callable, loss: Callable, options: StepOptions,
                 audited_loss: Callable | None = None):
        self.layout, self.mesh, self._declared_loss, self._loss, self.options = (layout, mesh, declared_loss, loss,
                                                                                  options)
        self._audited_loss = declared_loss if audited_loss is None else audited_loss  # the loss's own value
        self.model_state_checked = not options.has_state
        self.audited = not options.audit

    def audit(self, state: TrainState, placed, first_call: bool = False) -> Audit:
        """The audit of the loss on this batch (`jdp.core.audit.audit_loss`); AuditError if refused."""
        found = audit_loss(self.layout, self.mesh, self._audited_loss, self.options, state, placed, first_call)
        if found.verdict == "refused":
            raise AuditError(found, self.layout.num_devices, self.options)
        self.audited = True
        return found

    def sized(self, state: TrainState, placed) -> TrainState:
        """`state` with the accumulator's aux sums sized from aux's structure (traced on the mesh)."""
        if state.accum is None or state.accum.aux is not UNSIZED:
            return state
        one = jax.eval_shape(self.layout.canonical, state.replace(accum=None))
        aux = self.layout.loss_shapes(self._loss, one.params, one.model_state, placed)
        empty = jax.jit(lambda: self.layout.empty_accum(one.params, aux),
                        out_shardings=self.layout.state_shardings.accum)
        return state.replace(accum=empty())

    def check_model_state(self, state: TrainState, placed) -> None:
        """First call: the loss must hand back the model state in the structure it was given, and
        (sync_batchnorm=True) equal on every device, or averaging it would not be one device's step.

        The agreement check runs the loss's forward pass once more on this batch, compiled once:
        about the cost of compiling the forward pass, on the first call only.
        """
        if not jax.tree.leaves(state.model_state):
            self.model_state_checked = True
            return
        one = self.layout.canonical(state.replace(accum=None))  # one copy, params whole (FSDP keeps slices)
        batch = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), placed) if state.stacked else placed
        returned = self.layout.loss_shapes(self._declared_loss, one.params, one.model_state, placed, part=1)
        check_structure(one.model_state, returned)
        # the global view's statistics are the global batch's by construction: nothing per device to compare
        if self.options.sync_batchnorm and not self.layout.global_view:
            spread, scale = spread_over_devices(self._loss, self.mesh, one.params, one.model_state, batch, one.rng,
                                                one.micro_step)
            check_agreement(spread, scale, data_axes(self.mesh))
        self.model_state_checked = True
