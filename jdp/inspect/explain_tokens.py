"""`jdp explain`'s token-weighted part: three ways to average a per-token loss, side by side.

A language model's rows hold different numbers of real tokens. Dividing each device's token-loss
sum by its own count and averaging (Flax's pmap lm1b example), or dividing each micro-batch by its
own count (equal-weight accumulation, the bug Hugging Face transformers fixed in late 2024 with
`num_items_in_batch`), gives a mean of means. `jdp.Weighted(sum, count)` is divided once by the
count of the whole global batch: one device's step, per token. With `reduction="sum"` the psum of
the sums over the MEAN weight per device is N times the mean, so lr_correction="auto" (lr/N) stays
exact for SGD; the psum of per-device means with lr/N is the mean of per-device means again: the
correction for varying counts would be a factor per device (its share of the tokens), not 1/N.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdp.core.step import get_params, make_train_step
from jdp.core.weighting import Weighted
from jdp.inspect.explain_common import cpu_devices

V, D, L, B = 16, 8, 8, 2  # vocabulary, width, row length, rows per device and call
STEPS, LR = 3, 0.5


def _params():
    rng = np.random.default_rng(0)
    return {"emb": rng.normal(0, 1, (V, D)).astype(np.float32),
            "out": rng.normal(0, 1 / np.sqrt(D), (D, V)).astype(np.float32)}


def _batches(rows: int):
    """Rows with 1..L real tokens each, so counts differ per row, device and micro-batch."""
    rng = np.random.default_rng(3)
    out = []
    for _ in range(STEPS):
        lengths = rng.integers(1, L + 1, rows)
        out.append({"x": rng.integers(0, V, (rows, L)).astype(np.int32), "y": rng.integers(0, V, (rows, L)).astype(np.int32),
                    "w": (np.arange(L)[None, :] < lengths[:, None]).astype(np.float32)})
    return out


def _nll(params, batch):
    logits = jnp.tanh(params["emb"][batch["x"]]) @ params["out"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]) * batch["w"]


def weighted(params, batch):
    return Weighted(jnp.sum(_nll(params, batch)), jnp.sum(batch["w"]))


def own_count(params, batch):
    return jnp.sum(_nll(params, batch)) / jnp.sum(batch["w"])


def _reference(rows: int):
    params, tx = _params(), optax.sgd(LR)
    state, losses = tx.init(params), []
    for batch in _batches(rows):
        loss, grads = jax.value_and_grad(lambda p: weighted(p, batch).total / weighted(p, batch).weight)(params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return jax.device_get(params), losses


def _run(loss_fn, n: int, m: int, rows: int, backend: str = "shard_map", **options):
    # audit=False: the own-count rows measure the mean of per-device means the audit would refuse
    step = make_train_step(loss_fn, optax.sgd(LR), devices=cpu_devices(n), accum_steps=m, mask_key=None, audit=False,
                           backend=backend, **options)
    state = step.init(_params())
    for batch in _batches(rows):
        for micro in step.micro_batches(batch):
            state, metrics = step(state, micro)
    return get_params(state), float(metrics["loss"])


RUNS = (  # (label, loss, devices as n or 1, accum_steps, options)
    ("own count per device, then pmean (lm1b)", own_count, "n", 1, {}),
    ("own count per micro-batch (1 device, M=2)", own_count, 1, 2, {}),
    ("psum of per-device means, lr/N", own_count, "n", 1, {"reduction": "sum"}),
    ("jdp.Weighted, N devices × M=2", weighted, "n", 2, {}),
    ("jdp.Weighted, psum / mean weight, lr/N", weighted, "n", 2, {"reduction": "sum"}),
)


# Under backend="jit" the loss sees the whole batch: the "own count" of the first run is the whole
# batch's, and the runs with reduction="sum" (a per-device sum) do not apply.
JIT_LABELS = {RUNS[0][0]: "the batch's own count, N devices (backend='jit': the whole batch's)"}


def token_normalisations(n: int = 4, progress=None, backend: str = "shard_map") -> dict:
    """SGD on a tiny token model: max |Δparam| and final loss of each normalisation against one
    device's global token mean, on batches of 2·n·B rows whose real-token counts vary. Under
    backend="jit" the runs with reduction="sum" are left out and the first is relabelled."""
    tell = progress or (lambda k, total, what: None)
    rows = 2 * n * B
    counts = _batches(rows)[0]["w"].reshape(n, -1).sum(1).astype(int).tolist()  # step 0, per device (M = 1)
    want, losses = _reference(rows)
    out = []
    runs = [(JIT_LABELS.get(r[0], r[0]), *r[1:]) for r in RUNS if "reduction" not in r[4]] if backend == "jit" else RUNS
    for k, (label, loss_fn, devices, m, options) in enumerate(runs, 1):
        tell(k, len(runs), label)
        got, loss = _run(loss_fn, n if devices == "n" else devices, m, rows, backend, **options)
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in
                   zip(jax.tree.leaves(got), jax.tree.leaves(want)))
        out.append({"run": label, "max_abs_dparam": diff, "loss": loss})
    return {"devices": n, "rows": rows, "tokens_per_device": counts, "steps": STEPS, "reference_loss": losses[-1],
            "runs": out}


def render_token_normalisations(result: dict, console, table) -> None:
    t = table(f"Per-token loss (tokens per device at step 0: {result['tokens_per_device']}): SGD, "
              f"{result['steps']} steps vs one device's global token mean, loss {result['reference_loss']:.4f}",
              "normalisation", "final loss", "max |Δparam|", right=("final loss", "max |Δparam|"))
    for r in result["runs"]:
        ok = r["max_abs_dparam"] <= 1e-6
        t.add_row(r["run"], f"{r['loss']:.4f}", f"[{'green' if ok else 'red'}]{r['max_abs_dparam']:.1e}"
                  f"[/{'green' if ok else 'red'}]")
    console.print(t)
