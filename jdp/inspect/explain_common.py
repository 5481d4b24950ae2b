"""What every part of `jdp explain` shares: the devices, jdp's step built once per configuration,
the matrix's small problem and its optimizers, and the style of its tables.

`jdp.inspect.explain` (the seeds, the deviation matrix, Adam's ε, clipping, fp16, the report) and
`jdp.inspect.explain_precision` (bf16 gradient communication) both import this module; `jdp.inspect.explain`
also calls `jdp.inspect.explain_precision`, which imports nothing of `jdp.inspect.explain`: one direction only.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdp.core.optim import OptimizerSpec
from jdp.core.step import get_params, make_train_step


def cpu_devices(n: int) -> list:
    """The first `n` CPU devices; a ValueError saying how to get them if jax has fewer."""
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise ValueError(f"jdp explain needs {n} CPU devices but jax has {len(devices)}; call "
                         f"jdp.cpu.use_cpu_devices({n}) before any jax computation.")
    return devices[:n]


@functools.lru_cache(maxsize=256)
def cached_step(loss_fn, spec: OptimizerSpec, reduction: str, lr_correction, n: int, backend: str,
                reduce_dtype=None):
    """jdp's step for one configuration, built once and reused by every part that runs it.

    XLA's compilation is ~80% of each run here (~0.3 s against ~1 ms of stepping), and the parts
    share configurations: the clip threshold is the matrix's SGD reference, the Adam ε sweep and
    the clipping rates run rows of the matrix (the loss scale is a batch input, so one compiled
    step serves every scale). `jdp.inspect.explain.explain()` clears the cache when it returns.
    """
    return make_train_step(loss_fn, spec, backend=backend, reduction=reduction, lr_correction=lr_correction,
                           devices=cpu_devices(n), reduce_dtype=reduce_dtype)


@dataclass(frozen=True)
class Problem:
    """The small fixed problem of the matrix: a 2-layer MLP classifier and a few global batches."""

    params: dict
    batches: list

    @staticmethod
    def make(steps: int = 3, global_batch: int = 32, seed: int = 0) -> Problem:
        rng = np.random.default_rng(seed)
        params = {"w1": rng.normal(0, 0.5, (8, 16)).astype(np.float32), "b1": np.zeros(16, np.float32),
                  "w2": rng.normal(0, 0.25, (16, 4)).astype(np.float32), "b2": np.zeros(4, np.float32)}
        batches = [{"x": rng.normal(size=(global_batch, 8)).astype(np.float32),
                    "y": rng.integers(0, 4, global_batch).astype(np.int32)} for _ in range(steps)]
        return Problem(params, batches)


def mlp_loss(params, batch):
    """The mean cross-entropy times `batch["scale"]` (the same on every example: a loss scale the
    compiled step takes as input rather than as a constant, so that one compilation serves all)."""
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return batch["scale"][0] * optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def train_problem(problem: Problem, spec: OptimizerSpec, reduction: str, lr_correction, n: int,
                  backend: str = "shard_map", loss_scale: float = 1.0, reduce_dtype=None):
    """Params after training on `problem`, and the gradient norm each step saw (what clipping sees)."""
    step = cached_step(mlp_loss, spec, reduction, lr_correction, n, backend, reduce_dtype)
    state = step.init(problem.params)
    scale = np.full(len(problem.batches[0]["y"]), loss_scale, np.float32)
    norms = []
    for batch in problem.batches:
        state, metrics = step(state, {**batch, "scale": scale})
        norms.append(metrics["grad_norm"])
    return get_params(state), [float(x) for x in jax.device_get(norms)]


def max_abs_diff(a, b) -> float:
    """max |a − b| over every leaf of two pytrees of the same structure, in float64."""
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def matrix_specs(clip_norm: float) -> dict[tuple[str, bool], OptimizerSpec]:
    """The optimizer × clipping grid of the matrix."""
    base = {"sgd": OptimizerSpec("sgd", lr=0.1), "momentum": OptimizerSpec("momentum", lr=0.1),
            "adam": OptimizerSpec("adam", lr=1e-2), "adamw": OptimizerSpec("adamw", lr=1e-2, weight_decay=0.1)}
    return {(name, clip): spec.replace(clip_norm=clip_norm if clip else None)
            for name, spec in base.items() for clip in (False, True)}


def table(title: str, *columns: str, right: tuple[str, ...] = ()):
    """A rich Table in explain's style: `title` above it on the left, `columns` (those in `right`
    right-aligned). Cells wrap at spaces and fold a word too long for its column, so a table
    narrower than its content (80 columns when piped) wraps its cells instead of cutting them "…"."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for column in columns:
        t.add_column(column, justify="right" if column in right else "left", overflow="fold")
    return t
