"""`assert_data_parallel_exact`: does jdp on N devices take the steps plain one-device JAX takes?

Used by `jdp.testing` (which re-exports it) and by jdp's own tests. The reference never uses jdp's
step, and it is the definition: one device, one step on the whole global batch of each optimizer
step (`jdp.inspect.reference`), micro-batches only where the model's statistics make them part of it.
"""
from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jdp.core.step import get_tree
from jdp.core.step import make_train_step as make_array_step
from jdp.inspect.exactness_hints import failure_hint, leaves as _leaves
from jdp.inspect.exactness_report import ExactnessReport, LeafDiff, NotExactError
from jdp.inspect.reference import micro_batches, multi_steps_inner, one_device_reference, optimizer_batches
from jdp.inspect.replicas import check_replicas

# dtype: (rtol, atol). A leaf passes if max |jdp - reference| <= atol + rtol * max |reference|.
# Summing N shards in another order moves the last bits; measured over 6 steps of an MLP with SGD,
# momentum, Adam and AdamW + clipping on 2-8 devices, the largest differences are 1/20 (float32),
# 1/5 (float16, bfloat16) and 1/500 (float64) of these. Adam whose state is bfloat16 or float16
# is the exception: where a gradient is near zero its update flips sign, a few learning rates
# apart from one device; pass atol for it, and rtol/atol for long runs.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-12, 1e-12),
    "float32": (1e-5, 1e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (2e-2, 2e-2),
}


def default_tolerance(dtype) -> tuple[float, float]:
    """(rtol, atol) for leaves of `dtype`: `TOLERANCES`, and (0, 0) (bit-exact) for integers and bools."""
    name = jnp.dtype(dtype).name
    if name in TOLERANCES:
        return TOLERANCES[name]
    if jnp.issubdtype(dtype, jnp.inexact):  # complex, float8: by the width of their floats
        return TOLERANCES.get(jnp.finfo(dtype).dtype.name, TOLERANCES["bfloat16"])
    return 0.0, 0.0


_OWN_OPTIONS = ("backend", "devices", "accum_steps", "accum_sync", "has_aux", "has_state")
_NOT_ONE_DEVICE = {"needs_rng": "per-device random keys cannot equal one device's"}


@dataclass(frozen=True)
class _Setup:
    """What every run of one check shares: the loss as declared, the optimizer and the reference."""

    loss_fn: Callable
    tx: optax.GradientTransformation  # the one-device optimizer: MultiSteps' inner one, else as given
    start: object  # params, or an nnx model
    model_state: object  # has_state only: the initial model state (Linen's batch_stats)
    has_aux: bool
    has_state: bool
    rtol: float | None
    atol: float | None
    atol_for: tuple[tuple[str, float], ...] = ()  # (leaf name pattern, atol), the first match wins
    mask_key: str | None = None  # the step's mask_key ("auto" read as None, as the step reads it)
    every_k: int = 1  # an optax.MultiSteps optimizer's k: calls (batches) per optimizer step
    step_tx: object = None  # what jdp's step is given: the optimizer as the caller passed it


def assert_data_parallel_exact(loss_fn: Callable, optimizer, params_or_model, batches: Iterable, *,
                               devices: Sequence[jax.Device] | None = None,
                               backends: Sequence[str] | str = ("shard_map", "pmap"), accum_steps: int = 1,
                               accum_sync: Sequence[str] | str = ("every", "last"), has_aux: bool = False,
                               has_state: bool = False, model_state=None, rtol: float | None = None,
                               atol: float | None = None, atol_for: Mapping[str, float] | None = None,
                               **step_options) -> ExactnessReport:
    """Assert that jdp on N devices takes the steps one device takes on the same global batches.

    Args:
      loss_fn: `loss_fn(params, batch)` (array params) or `loss_fn(model, batch)` (an nnx model):
        the MEAN loss over the examples it is given, as for `jdp.make_train_step`, or
        `jdp.Weighted(sum, weight)`, e.g. over real tokens (array params or a model), whose reference divides the
        sums of each optimizer step's whole global batch by its whole weight once; `(loss, aux)`
        with has_aux (aux: scalar means such as accuracy; compared too). With has_state (array
        params, e.g. a Linen model with BatchNorm): `loss_fn(params, model_state, batch) -> (loss,
        new_model_state)`, or `(loss, (aux, new_model_state))` with has_aux.
      optimizer: an optax transformation (or, for a model, an `nnx.Optimizer`: its `tx`), or an
        `optax.MultiSteps(inner, k)` as the step takes it (then accum_steps=1, and every k batches
        are one optimizer step: the reference is one step of `inner` on those k batches together).
      params_or_model: a pytree of arrays, or an `nnx.Module` (never modified). A model that draws
        random numbers (Dropout) cannot match one device: make it deterministic for this test.
      batches: global batches, each `accum_steps` × N × b examples along the leading axis (a step each).
      devices: the N devices, default all of `jax.devices()` (at least 2 unless given).
      backends, accum_sync: every combination is run (accum_sync only when accum_steps > 1; "jit"
        with "every" only, as it refuses "last"), each compiled once; so is the reference.
      accum_steps: M micro-batches per optimizer step. The reference is still one step on the
        whole global batch: a loss that is not a mean over examples (it divides by the micro-batch's
        own count of tokens) fails here, as it fails the definition. Only a model with batch
        statistics (has_state, an nnx `BatchStat`) has its micro-batches in its definition: its
        reference steps `optax.MultiSteps(optimizer, M)` through the same M micro-batches.
      has_state, model_state: array params with non-parameter state (Linen's `batch_stats`): the
        state is compared too.
      rtol, atol: a leaf passes if max |jdp - reference| <= atol + rtol · max |reference|;
        default by the leaf's dtype, `TOLERANCES` (float32: 1e-5 each). Pass your own for a model
        that computes in lower precision than its params, or for long runs.
      atol_for: {leaf name or fnmatch pattern: atol} for params and model state leaves named as the
        report names them (`{"params.attn.bk": 1e-2}`, `{"params.*.bias": 1e-2}`): those leaves'
        atol (rtol stays). For a leaf whose true gradient is 0 (an attention key bias), where Adam
        turns rounding into steps of the learning rate's size; a pattern that matches no leaf is refused.
      **step_options: passed on to the step (`reduction`, `lr_correction`, `skip_nonfinite`,
        `mask_key` (default None here: the batch is taken as it is), `audit` (default False here:
        the comparison sees an own-count loss itself, and names it), `axis_name` (the mesh axis
        the loss reduces over, e.g. 'batch' for `nn.BatchNorm(axis_name='batch')`), and for a model
        `sync_batchnorm`).

    The reference is independent of jdp, and it is the definition: `jax.jit` of
    `jax.value_and_grad` and the optax update, ONE step on the WHOLE global batch of each optimizer
    step (its M micro-batches, or a MultiSteps' k batches, together) on the first device, the loss
    run with `axis_name` bound on that one device (`jax.vmap` over an axis of size 1, so a
    BatchNorm's or a metric's `lax.pmean` is the identity); for an nnx model, `nnx.value_and_grad`
    and an `nnx.Optimizer`, BatchNorm statistics compared too (with them, and with has_state, the
    micro-batches are part of the model's definition: `optax.MultiSteps` over them); a
    `jdp.Weighted` loss's reference sums each optimizer step's totals, gradients and weights and
    divides once. Per run, the
    params (and model state), the loss and aux of every step, the optimizer step count and the
    replicas (`jdp.check_replicas`) are checked.

    Returns the `ExactnessReport` (print it). Raises `NotExactError` (an AssertionError): with the
    report, failing leaves first, when a leaf is beyond its tolerance or when the reference moved no
    parameter beyond its tolerance (the comparison would prove nothing); without it (`.report` None)
    when the reference went NaN/Inf, or a run's replicas or optimizer step count are wrong. A
    plain loss that fails because it is not a mean over examples (it divides by each device's own
    count of tokens), or a `jdp.Weighted` loss whose total is not a sum, is named as the cause, with
    the form that fixes it; so are failing leaves whose gradient is ~0 (`atol_for` above).
    """
    batches, backends, syncs = _checked_arguments(batches, backends, accum_sync, step_options)
    devices = _checked_devices(devices)
    setup = _setup(loss_fn, optimizer, params_or_model, has_aux, has_state, model_state, rtol, atol, atol_for,
                   step_options["mask_key"])
    axis = step_options.get("axis_name", "data")
    reference = one_device_reference(setup, loss_fn, params_or_model, batches, accum_steps, has_aux, axis, devices[0])
    _check_reference_finite(reference[1])
    _check_atol_for(setup, reference[1])
    rows, labels = [], []
    for backend in backends:
        for sync in (syncs if accum_steps > 1 else syncs[:1]):
            if backend == "jit" and accum_steps > 1 and sync == "last" and len(syncs) > 1:
                continue  # backend="jit" refuses "last": the partitioner all-reduces every call's gradient
            label = backend if accum_steps == 1 else f"{backend}, accum_sync={sync!r}"
            labels.append(label)
            options = dict(step_options, backend=backend, devices=devices, accum_steps=accum_steps, accum_sync=sync)
            rows += _compare_run(label, setup, _run_jdp(label, setup, batches, options), reference)
    try:
        return _verdict(rows, labels, len(devices), len(batches))
    except NotExactError as e:
        if e.report is None or e.report.ok:
            raise
        # under jit alone a loss sees whole micro-batches: measure the parts it is averaged over there
        jit_only, k = set(backends) == {"jit"}, setup.every_k
        parts = ((batches[0], accum_steps, "micro-batches") if jit_only and accum_steps > 1 else
                 (optimizer_batches(batches[:k], k)[0], k, "batches of one optax.MultiSteps step") if jit_only and k > 1
                 else (micro_batches(batches[0], accum_steps)[0], len(devices), "device shards"))
        hint = failure_hint(setup, e.report.failures, *parts, axis)
        if hint is None:
            raise
        raise NotExactError(f"{hint}\n{e}", e.report) from None


def _checked_arguments(batches, backends, accum_sync, step_options):
    batches = list(batches)
    if not batches:
        raise ValueError("batches is empty; pass at least one global batch.")
    backends = (backends,) if isinstance(backends, str) else tuple(backends)
    syncs = (accum_sync,) if isinstance(accum_sync, str) else tuple(accum_sync)
    if not backends or not syncs:
        raise ValueError("backends and accum_sync must name at least one each.")
    for name in step_options:
        if name in _OWN_OPTIONS:
            raise ValueError(f"{name} is an argument of assert_data_parallel_exact itself; it is not a step option.")
        if name in _NOT_ONE_DEVICE:
            raise ValueError(f"{name} cannot be checked against one device: {_NOT_ONE_DEVICE[name]}.")
    step_options.setdefault("mask_key", None)
    step_options.setdefault("audit", False)  # the comparison with one device sees what the audit sees, and names it
    return batches, backends, syncs


def _checked_devices(devices) -> list:
    if devices is None:
        devices = jax.devices()
        if len(devices) < 2:
            raise ValueError("jax has only 1 device, so nothing data-parallel would be tested: run pytest with "
                             "--jdp-devices N, or call jdp.cpu.use_cpu_devices(N) before any jax computation.")
    return list(devices)


def _setup(loss_fn, optimizer, start, has_aux, has_state, model_state, rtol, atol, atol_for, mask_key) -> _Setup:
    is_model = isinstance(start, nnx.Module)
    given = optimizer.tx if is_model and isinstance(optimizer, nnx.Optimizer) else optimizer
    tx, every_k = multi_steps_inner(given)
    if not isinstance(tx, optax.GradientTransformation):
        raise ValueError(f"optimizer must be an optax.GradientTransformation or an optax.MultiSteps"
                         f"{' or an nnx.Optimizer' if is_model else ''}, got {type(optimizer).__name__}.")
    if has_state and is_model:
        raise ValueError("has_state is for array params (e.g. Linen's batch_stats); an nnx model's BatchNorm "
                         "statistics are found and compared without it.")
    if has_state != (model_state is not None and bool(jax.tree.leaves(model_state))):
        raise ValueError("has_state=True and model_state=... go together: pass both (the model state the loss "
                         "takes, e.g. variables['batch_stats']), or neither.")
    if atol_for is not None and not (isinstance(atol_for, Mapping) and all(
            isinstance(k, str) and isinstance(v, (int, float)) and v >= 0 for k, v in atol_for.items())):
        raise ValueError(f"atol_for must map leaf names (or fnmatch patterns) to tolerances >= 0, e.g. "
                         f"{{'params.attn.bk': 1e-2}}; got {atol_for!r:.80}.")
    return _Setup(loss_fn, tx, start, model_state, has_aux, has_state, rtol, atol,
                  tuple((k, float(v)) for k, v in (atol_for or {}).items()), None if mask_key == "auto" else mask_key,
                  every_k, given)


def _check_atol_for(setup: _Setup, ref_final) -> None:
    names = [group + path for group in ref_final for path in _leaves(ref_final[group])]
    for pattern, _ in setup.atol_for:
        if not fnmatch.filter(names, pattern):
            raise ValueError(f"atol_for names {pattern!r}, which matches no leaf; the leaves are "
                             f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}.")


def _leaf_atol(setup: _Setup, name: str) -> float | None:
    return next((a for pattern, a in setup.atol_for if fnmatch.fnmatchcase(name, pattern)), setup.atol)


def _check_reference_finite(ref_final) -> None:
    bad = [group + path for group in ref_final for path, x in _leaves(ref_final[group]).items()
           if jnp.issubdtype(x.dtype, jnp.inexact) and not np.all(np.isfinite(x))]
    if bad:
        raise NotExactError(f"the one-device reference itself produced NaN or Inf in {', '.join(bad[:5])}"
                            f"{' ...' if len(bad) > 5 else ''}, so comparing with it proves nothing; fix the "
                            f"model, the data or the optimizer (e.g. Adam's eps underflows in float16).", None)


def _run_jdp(label: str, setup: _Setup, batches: list, options: dict):
    """One jdp run over every batch: (final params [and model state], per-step losses, per-step aux)."""
    is_model = isinstance(setup.start, nnx.Module)
    if is_model:
        step = _nnx_make_train_step(setup.start, setup.loss_fn, setup.step_tx, has_aux=setup.has_aux, **options)
        state = step.init(seed=0)
    else:
        step = make_array_step(setup.loss_fn, setup.step_tx, has_aux=setup.has_aux, has_state=setup.has_state,
                               **options)
        state = step.init(setup.start, setup.model_state if setup.has_state else ())
    losses, auxes = [], []
    for batch in batches:
        for micro in step.micro_batches(batch):
            state, metrics = step(state, micro)
        losses.append(metrics["loss"])
        auxes.append(metrics.get("aux", {}))
    try:
        check_replicas(state)
    except AssertionError as e:
        raise NotExactError(f"{label}: the devices' copies of the state differ: {e}", None) from e
    taken = int(get_tree(state, state.step))
    if taken != len(batches):
        raise NotExactError(f"{label}: {taken} step(s) taken for {len(batches)} global batches.", None)
    final = {"params": get_tree(state, state.params)}
    if is_model or setup.has_state:
        final["model_state"] = get_tree(state, state.model_state)
    k = setup.every_k  # MultiSteps: the mean of its k calls' losses, the loss of its optimizer step
    losses, auxes = jax.device_get(losses), jax.device_get(auxes)
    return (final, [np.mean(np.stack(losses[i:i + k]), 0) for i in range(0, len(losses), k)],
            [jax.tree.map(lambda *xs: np.mean(np.stack(xs), 0), *auxes[i:i + k]) for i in range(0, len(auxes), k)])


def _compare_run(label: str, setup: _Setup, run, reference) -> list[LeafDiff]:
    (final, losses, auxes), (initial, ref_final, ref_losses, ref_aux) = run, reference
    rows = _compare(label, final, ref_final, initial, setup)
    rows += _compare_steps(label, "loss", losses, ref_losses, setup.rtol, setup.atol)
    if setup.has_aux:
        got_aux, want_aux = _per_step(auxes), _per_step(ref_aux)
        if got_aux.keys() != want_aux.keys():
            raise NotExactError(f"{label}: the step's aux has {sorted(got_aux)}, the reference's "
                                f"{sorted(want_aux)}.", None)
        for path, want in want_aux.items():
            rows += _compare_steps(label, "aux" + path, got_aux[path], want, setup.rtol, setup.atol)
    return rows


def _verdict(rows: list[LeafDiff], labels: list[str], devices: int, steps: int) -> ExactnessReport:
    rows.sort(key=lambda r: (-r.ratio, -r.diff, r.run, r.name))
    report = ExactnessReport(tuple(rows), devices, steps, tuple(labels))
    if not report.ok:
        raise NotExactError(f"jdp on {devices} devices does not take the one-device steps: "
                            f"{len(report.failures)} of {len(rows)} leaves beyond tolerance (worst first; "
                            f"runs: {', '.join(labels)}):\n{report.table(limit=max(20, len(report.failures)))}", report)
    param_rows = [r for r in rows if r.name.startswith("params")]
    if not any(r.moved > r.tol for r in param_rows):
        top = max(param_rows, key=lambda r: r.moved)
        raise NotExactError(f"the one-device reference changed no parameter beyond its tolerance (largest: "
                            f"{top.name} by {top.moved:.2e}, tolerance {top.tol:.2e}), so this comparison would "
                            f"pass for any step; use a larger learning rate or more batches.", report)
    return report


def _nnx_make_train_step(model, loss_fn, optimizer, **options):
    from jdp.bridges.nnx import make_train_step

    return make_train_step(model, loss_fn, optimizer, **options)


def _per_step(trees: list) -> dict[str, list[np.ndarray]]:
    """[{aux} per step] as {".name": [value per step]}."""
    per_step = [_leaves(t) for t in trees]
    return {path: [leaves[path] for leaves in per_step] for path in per_step[0]}


def _tolerance(ref: np.ndarray, rtol, atol) -> float:
    default_r, default_a = default_tolerance(ref.dtype)
    r = default_r if rtol is None else rtol
    a = default_a if atol is None else atol
    scale = float(np.max(np.abs(ref.astype(np.float64)))) if ref.size else 0.0
    return a + r * (scale if math.isfinite(scale) else 0.0)


def _max_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return math.inf
    if not a.size:
        return 0.0
    both_nan = np.isnan(a) & np.isnan(b)
    diff = np.where(both_nan, 0.0, np.abs(a - b))
    return float(np.max(np.where(np.isnan(diff), math.inf, diff)))


def _compare(label, got, want, initial, setup: _Setup) -> list[LeafDiff]:
    rows = []
    for group in want:
        g, w, i = _leaves(got[group]), _leaves(want[group]), _leaves(initial[group])
        if g.keys() != w.keys():
            raise AssertionError(f"{label}: the step's {group} have leaves {sorted(g)}, the reference's {sorted(w)}.")
        for path, ref in w.items():
            rows.append(LeafDiff(label, group + path, _max_diff(g[path], ref),
                                 _tolerance(ref, setup.rtol, _leaf_atol(setup, group + path)),
                                 _max_diff(ref, i[path]), ref.dtype.name))
    return rows


def _compare_steps(label, name, got, want, rtol, atol) -> list[LeafDiff]:
    """One row for a per-step scalar (loss, aux): the worst step, at the coarser of the two dtypes (jdp
    reports the loss in float32)."""
    got, want = np.stack([np.asarray(x) for x in got]), np.stack([np.asarray(x) for x in want])
    coarse = max((got.dtype, want.dtype), key=_resolution)
    return [LeafDiff(label, name, _max_diff(got, want), _tolerance(want.astype(coarse), rtol, atol), math.nan,
                     coarse.name)]


def _resolution(dtype) -> float:
    return float(jnp.finfo(dtype).eps) if jnp.issubdtype(dtype, jnp.inexact) else 0.0


__all__ = ["ExactnessReport", "LeafDiff", "NotExactError", "TOLERANCES", "assert_data_parallel_exact",
           "default_tolerance"]
