"""`jdp explain`: why gradients are averaged, shown by running jdp's own step on fake devices.

Every number here comes from `make_train_step` on CPU devices; nothing is hard-coded. The seed
regressions (`jdp.data.SEED_REGRESSIONS`: y = w·x, mean-squared error, one SGD step) must come out
as worked by hand there.
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jdp.core.mesh import DATA_AXIS, make_mesh
from jdp.core.optim import OptimizerSpec
from jdp.core.reduce import mean_over_devices, sum_over_devices
from jdp.core.step import get_params
from jdp.data import SEED_REGRESSIONS, load_seed_regression
from jdp.inspect import explain_precision, explain_tokens
from jdp.inspect.explain_common import Problem, cached_step, cpu_devices, matrix_specs, max_abs_diff, table, train_problem

EXPLAIN_DEVICES = 8  # fake CPU devices `jdp explain` needs
# What one `jdp explain` costs, measured: the whole run, `time jdp explain --json`, on 2-core CPUs
# shared with other work (load average 7 to 8): 434 s and 466 s. Most of it is compiling its steps.
MEASURED_TIME = "434-466 s measured on a 2-core CPU shared with other work (load average 7-8)"
REDUCTIONS = {  # name -> (reduction, lr_correction)
    "mean": ("mean", None),
    "sum raw": ("sum", "none"),
    "sum + auto LR": ("sum", "auto"),
    "sum + exact": ("sum", "exact"),
}


# Under backend="jit" the loss sees the whole batch and the partitioner places the all-reduce, so
# there is no per-device gradient to sum or to send in another dtype: these parts compare
# per-device reductions and do not apply. The seeds, the matrix (its mean rows) and the token
# normalisations run: they are the exactness checks.
SKIPPED_UNDER_JIT = ("skipped under backend='jit': it compares per-device reductions (psum, pmean, reduce_dtype), "
                     "and the global view has none")
PER_DEVICE_PARTS = ("bf16_comm", "adam_eps", "clipping", "fp16")


def reductions(backend: str) -> dict:
    """The matrix's reductions under `backend`: all of REDUCTIONS, or the mean alone under "jit"."""
    return {"mean": REDUCTIONS["mean"]} if backend == "jit" else REDUCTIONS


def _mse(params, batch):
    """Mean squared error of y = x·w (or w·x for scalar w) over the examples given."""
    x = batch["x"]
    pred = x @ params["w"] if x.ndim == 2 else x * params["w"]
    return jnp.mean((pred - batch["t"]) ** 2)


def _step_once(x, t, w, lr, n, reduction="mean", lr_correction=None, backend="shard_map"):
    step = cached_step(_mse, OptimizerSpec("sgd", lr=lr), reduction, lr_correction, n, backend)
    state, _ = step(step.init({"w": np.asarray(w, np.float32)}), {"x": x, "t": t})
    return get_params(state)["w"].astype(np.float64)


def _grad(x, t, w, n, reduction="mean", backend="shard_map"):
    """The reduced gradient, read off one SGD step with lr = 1 (w' = w - g, exact in float32)."""
    return np.asarray(w, np.float64) - _step_once(x, t, w, 1.0, n, reduction, "none" if reduction == "sum" else None,
                                                  backend)


def _seed(x, t, w, lr, n, backend):
    shards = np.split(np.arange(len(x)), n)
    r = lambda a: np.round(a, 4).tolist()  # noqa: E731  (float32 steps: 4 decimals are exact)
    per_device = {} if backend == "jit" else {  # a per-device sum: the global view has none (SKIPPED_UNDER_JIT)
        "sum": {"grad": r(_grad(x, t, w, n, "sum", backend)),
                "w": r(_step_once(x, t, w, lr, n, "sum", "none", backend))},
        "sum_lr_over_n": {"lr": lr / n, "w": r(_step_once(x, t, w, lr, n, "sum", "auto", backend))}}
    return {
        "w0": r(np.asarray(w, np.float64)), "lr": lr, "devices": n,
        "one_device": {"grad": r(_grad(x, t, w, 1, backend=backend)), "w": r(_step_once(x, t, w, lr, 1, backend=backend))},
        "local_grads": [r(_grad(x[s], t[s], w, 1, backend=backend)) for s in shards],
        "mean": {"grad": r(_grad(x, t, w, n, backend=backend)), "w": r(_step_once(x, t, w, lr, n, backend=backend))},
        **per_device,
    }


def _seed_number(number: int, backend: str) -> dict:
    seed, arrays = SEED_REGRESSIONS[number], load_seed_regression(number).arrays
    return _seed(arrays["x"], arrays["t"], seed.w0, seed.lr, seed.devices, backend)


def seed_single_param(backend: str = "shard_map") -> dict:
    """Seed regression 1 (one weight, four examples) on one device and on `SEED_REGRESSIONS[1].devices`."""
    return _seed_number(1, backend)


def seed_two_params(backend: str = "shard_map") -> dict:
    """Seed regression 2 (y = w1·x1 + w2·x2, eight examples) on one device and on `SEED_REGRESSIONS[2].devices`."""
    return _seed_number(2, backend)


def clip_threshold(problem: Problem) -> float:
    """A max-norm that the mean gradient stays under while the N× sum exceeds it (1.5× the first norm)."""
    _, norms = train_problem(Problem(problem.params, problem.batches[:1]), OptimizerSpec("sgd", lr=0.1), "mean",
                             None, 1)
    return float(np.round(1.5 * norms[0], 3))


Row = Callable[[int, int, str], object]  # progress(k, n, what): the k-th of n items, doing `what`, starts


def _tell(progress: Row | None, k: int, n: int, what: str) -> None:
    if progress is not None:
        progress(k, n, what)


def deviation_matrix(ns=(2, 4, 8), backend: str = "shard_map", problem: Problem | None = None, *,
                     progress: Row | None = None) -> list[dict]:
    """max |Δparam| vs the one-device run, for optimizer × clipping × reduction × N.

    `progress(k, n, what)` is called as the k-th of its n optimizer × clipping rows starts.
    """
    problem = problem or Problem.make()
    clip = clip_threshold(problem)
    specs = matrix_specs(clip)
    rows = []
    for k, ((name, clipped), spec) in enumerate(specs.items(), 1):
        _tell(progress, k, len(specs), f"{name}, clip {'on' if clipped else 'off'}")
        reference, _ = train_problem(problem, spec, "mean", None, 1, backend)
        for label, (reduction, correction) in reductions(backend).items():
            for n in ns:
                params, _ = train_problem(problem, spec, reduction, correction, n, backend)
                rows.append({"optimizer": name, "clip": clipped, "clip_norm": clip if clipped else None,
                             "reduction": label, "devices": n,
                             "max_abs_dparam": max_abs_diff(params, reference)})
    return rows


def adam_eps_sweep(n: int = 8, scales=(1.0, 1e-3, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9, 1e-10),
                   backend: str = "shard_map", *, progress: Row | None = None) -> list[dict]:
    """Adam (ε = 1e-8): how far raw psum strays from pmean as the gradient shrinks towards ε.

    The loss is multiplied by `scale`, so gradients scale with it; Adam's step would not change at
    all but for ε. `relative_deviation` = max |Δparam(sum) − Δparam(mean)| / max |Δparam(mean)|.
    `progress(k, n, what)` is called as each scale starts.
    """
    problem = Problem.make()
    spec = OptimizerSpec("adam", lr=1e-2)
    n_params = sum(np.size(p) for p in jax.tree.leaves(problem.params))
    rows = []
    for k, scale in enumerate(scales, 1):
        _tell(progress, k, len(scales), f"loss × {scale:g}, mean and raw sum on {n} devices")
        mean, norms = train_problem(problem, spec, "mean", None, n, backend, scale)
        raw, _ = train_problem(problem, spec, "sum", "none", n, backend, scale)
        moved = max_abs_diff(mean, problem.params)
        rows.append({"loss_scale": scale, "rms_grad": norms[0] / np.sqrt(n_params),
                     "relative_deviation": max_abs_diff(raw, mean) / moved})
    return rows


def clipping_rates(n: int = 8, steps: int = 20, backend: str = "shard_map", *,
                   progress: Row | None = None) -> list[dict]:
    """How many of `steps` steps each reduction clips, at one max-norm, with SGD + clip.

    `progress(k, n, what)` is called as each reduction starts.
    """
    problem = Problem.make(steps=steps)
    clip = clip_threshold(problem)
    spec = OptimizerSpec("sgd", lr=0.1, clip_norm=clip)
    rows = []
    for k, (label, (reduction, correction)) in enumerate(REDUCTIONS.items(), 1):
        _tell(progress, k, len(REDUCTIONS), f"{label}, {steps} steps on {n} devices")
        _, norms = train_problem(problem, spec, reduction, correction, n, backend)
        threshold = clip * n if correction == "exact" else clip  # what the clip transform compares with
        rows.append({"reduction": label, "clip_norm": threshold, "steps": steps,
                     "clipped_steps": int(sum(x > threshold for x in norms)),
                     "median_grad_norm_seen": float(np.median(norms))})
    return rows


def fp16_overflow(n: int = 8) -> dict:
    """Eight devices' fp16 gradients of 9000..9700: their plain sum (74,800) exceeds fp16's 65,504."""
    grads = (9000.0 + 100.0 * np.arange(n)).astype(np.float16)
    mesh = make_mesh(cpu_devices(n))
    spec = jax.sharding.PartitionSpec(DATA_AXIS)

    def reduced(fn):
        return float(np.asarray(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)(grads))[0])

    return {"devices": n, "per_device_grads": grads.astype(float).tolist(), "fp16_max": float(np.finfo(np.float16).max),
            "true_mean": float(grads.astype(np.float64).mean()),
            "psum": reduced(sum_over_devices),
            "lax_pmean": reduced(lambda g: jax.lax.pmean(g, DATA_AXIS)),
            "jdp_mean_divide_first": reduced(mean_over_devices)}


CONCLUSION = (
    "Averaging is the only reduction that needs no knowledge of the optimizer: each device's mean "
    "loss, averaged over devices, is the mean over the whole global batch, so N devices take exactly "
    "the one-device step (deviations at float32 rounding). Summing multiplies the gradient by N. "
    "Dividing the learning rate by N undoes that only where the update is linear in the gradient "
    "(SGD, momentum); Adam normalises the gradient away, so lr/N makes its steps about N times too "
    "small, while the raw sum is almost right except where gradients are as small as ε; clipping "
    "compares an N-times norm with the threshold and clips when the mean would not; AdamW's weight "
    "decay gets divided too. Each difference comes from exactly one hyperparameter that is not "
    "scale-free (lr for SGD, ε for Adam, the max-norm for clipping), and correcting that one value "
    "makes the sum exact again. In fp16 the sum itself can overflow, so jdp divides before it sums. "
    "Per token, a mean is exact only when it is divided once by the global count: every device and "
    "micro-batch that divides by its own count averages means, which jdp.Weighted(sum, count) avoids.")


# The parts of `explain()`'s report, in the order it computes them: result key -> what it is.
PARTS = {"seed_single_param": "seed regression 1", "seed_two_params": "seed regression 2",
         "matrix": "deviation matrix", "bf16_comm": "bf16 gradient communication", "adam_eps": "Adam ε sweep",
         "clipping": "clipping rates", "fp16": "fp16 overflow", "tokens": "token-weighted means"}


@dataclass(frozen=True)
class Progress:
    """Where `explain()` is: part `number` of len(PARTS), `name`, at item `item` of `items`."""

    number: int
    name: str
    item: int = 1
    items: int = 1
    what: str = ""

    def __str__(self) -> str:
        text = f"part {self.number} of {len(PARTS)}: {self.name}"
        if self.what or self.items > 1:  # an item of the part
            text += f", {self.item} of {self.items}" + (f" ({self.what})" if self.what else "")
        return text


def explain(ns=(2, 4, 8), backend: str = "shard_map", progress: Callable[[Progress], object] | None = None) -> dict:
    """All of `jdp explain`'s results, as plain data. `progress(Progress)`, if given, is called as
    each part starts and as each of its items (matrix rows, bf16 runs, loss scales, reductions) starts."""
    tell = progress or (lambda event: None)
    t0 = time.perf_counter()
    n = max(ns)
    runs = {"seed_single_param": lambda row: seed_single_param(backend),
            "seed_two_params": lambda row: seed_two_params(backend),
            "matrix": lambda row: deviation_matrix(ns, backend, progress=row),
            "bf16_comm": lambda row: explain_precision.bf16_communication(ns, backend, progress=row),
            "adam_eps": lambda row: adam_eps_sweep(n, backend=backend, progress=row),
            "clipping": lambda row: clipping_rates(n, backend=backend, progress=row),
            "fp16": lambda row: fp16_overflow(n),
            "tokens": lambda row: explain_tokens.token_normalisations(min(n, 4), progress=row, backend=backend)}
    if backend == "jit":
        runs.update({key: lambda row: {"skipped": SKIPPED_UNDER_JIT} for key in PER_DEVICE_PARTS})
    results = {}
    try:
        for number, (key, run) in enumerate(runs.items(), 1):
            part = functools.partial(Progress, number, PARTS[key])
            tell(part())
            results[key] = run(lambda k, total, what: tell(part(k, total, what)))
    finally:
        cached_step.cache_clear()  # the compiled steps are of no use to anything else
    return {**results, "conclusion": CONCLUSION, "backend": backend, "seconds": round(time.perf_counter() - t0, 1)}


@contextlib.contextmanager
def progress_to(stream):
    """A `progress` for `explain()` that writes to `stream` (stderr, so stdout stays the report):
    a rich line with a bar while `stream` is a terminal, plain lines otherwise (logs, pipes)."""
    if not stream.isatty():
        yield lambda event: print(f"jdp explain: {event}", file=stream, flush=True)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

    bar = Bar(TextColumn("jdp explain: {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
              console=Console(file=stream), transient=True)
    task = bar.add_task("", total=1)
    with bar:
        yield lambda e: bar.update(task, description=f"part {e.number}/{len(PARTS)} {e.name}"
                                   + (f": {e.what}" if e.what else ""), completed=e.item - 1, total=e.items)


def _fmt(x: float) -> str:
    return f"{x:.1e}" if x < 1e-3 else f"{x:.4f}"


def _seed_table(title: str, seed: dict):
    n, lr = seed["devices"], seed["lr"]
    t = table(title, "run", "gradient", "w after one step")
    fmt = lambda v: str(v if isinstance(v, list) else round(v, 4))  # noqa: E731
    t.add_row(f"1 device, whole batch (lr {lr})", fmt(seed["one_device"]["grad"]), fmt(seed["one_device"]["w"]))
    for i, g in enumerate(seed["local_grads"]):
        t.add_row(f"  device {i + 1}, its shard only", fmt(g), "")
    if "sum" not in seed:  # backend="jit": the loss's own mean over the whole batch, and no psum
        t.add_row(f"{n} devices, the global batch's mean", fmt(seed["mean"]["grad"]), fmt(seed["mean"]["w"]))
        t.add_row(f"{n} devices, sum (psum): {SKIPPED_UNDER_JIT.split(':')[0]}", "", "")
        return t
    t.add_row(f"{n} devices, mean (pmean)", fmt(seed["mean"]["grad"]), fmt(seed["mean"]["w"]))
    t.add_row(f"{n} devices, sum (psum)", fmt(seed["sum"]["grad"]), fmt(seed["sum"]["w"]))
    t.add_row(f"{n} devices, sum with lr/{n} = {seed['sum_lr_over_n']['lr']:g}", "", fmt(seed["sum_lr_over_n"]["w"]))
    return t


def _matrix_table(rows: list[dict]):
    ns = sorted({r["devices"] for r in rows})
    clip = next((r["clip_norm"] for r in rows if r["clip"]), None)
    columns = [f"N={n}" for n in ns]
    t = table(f"max |Δparam| vs one device after {len(Problem.make().batches)} steps (MLP 8-16-4, global batch 32; "
              f"clip = clip_by_global_norm({clip}))", "optimizer", "clip", "reduction", *columns, right=tuple(columns))
    for key in dict.fromkeys((r["optimizer"], r["clip"], r["reduction"]) for r in rows):
        vals = {r["devices"]: r["max_abs_dparam"] for r in rows if (r["optimizer"], r["clip"], r["reduction"]) == key}
        cells = [f"[green]{_fmt(vals[n])}[/green]" if vals[n] <= 1e-6 else f"[red]{_fmt(vals[n])}[/red]" for n in ns]
        t.add_row(key[0], "on" if key[1] else "off", key[2], *cells)
    return t


def render(results: dict, console=None) -> None:
    """Print `explain()`'s results as tables (rich), each within `console`'s width (80 when piped)."""
    from rich.console import Console

    console = console or Console()
    console.print("[bold]Why average? jdp's step on fake CPU devices[/bold] "
                  f"(backend {results['backend']}, {results['seconds']} s)\n")
    one, two = results["seed_single_param"], results["seed_two_params"]
    console.print(_seed_table(f"Seed 1: y = w·x, MSE, w = {one['w0']:g}", one))
    console.print(_seed_table(f"Seed 2: y = w1·x1 + w2·x2, MSE, w = ({', '.join(map(str, two['w0']))})", two))
    console.print(_matrix_table(results["matrix"]))
    for key in PER_DEVICE_PARTS:
        if "skipped" in results[key]:
            console.print(f"{PARTS[key]}: {results[key]['skipped']}")
    if "skipped" not in results["bf16_comm"]:
        explain_precision.render_bf16_communication(results["bf16_comm"], console)

    if "skipped" not in results["adam_eps"]:
        right = ("loss ×", "RMS gradient", "|Δ(sum) − Δ(mean)| / |Δ(mean)|")
        t = table("Adam (ε = 1e-8): raw sum vs mean as gradients shrink towards ε", *right, right=right)
        for r in results["adam_eps"]:
            t.add_row(f"{r['loss_scale']:g}", f"{r['rms_grad']:.1e}", f"{r['relative_deviation']:.2e}")
        console.print(t)
    if "skipped" not in results["clipping"]:
        right = ("reduction", "threshold compared", "median norm seen", "clipped steps")
        t = table("Clipping: steps clipped at one max-norm (SGD + clip_by_global_norm)", *right, right=right)
        for r in results["clipping"]:
            t.add_row(r["reduction"], f"{r['clip_norm']:g}", f"{r['median_grad_norm_seen']:.3f}",
                      f"{r['clipped_steps']} of {r['steps']}")
        console.print(t)
    if "skipped" not in results["fp16"]:
        f = results["fp16"]
        t = table(f"fp16: {f['devices']} devices' gradients {f['per_device_grads'][0]:g}..{f['per_device_grads'][-1]:g} "
                  f"(fp16 max {f['fp16_max']:g}; true mean {f['true_mean']:g})", "reduction", "result", right=("result",))
        t.add_row("psum", str(f["psum"]))
        t.add_row("lax.pmean (sum, then divide)", str(f["lax_pmean"]))
        t.add_row("jdp mean (divide, then sum)", str(f["jdp_mean_divide_first"]))
        console.print(t)

    if "tokens" in results:
        explain_tokens.render_token_normalisations(results["tokens"], console, table)
    console.print("\n[bold]Conclusion.[/bold] " + results["conclusion"])


def plot(results: dict, path: str) -> None:
    """Save deviation vs N, one panel per optimizer, one line per reduction (needs matplotlib)."""
    from jdp.extras import require

    require("matplotlib", "plot", "--plot").use("Agg")
    import matplotlib.pyplot as plt

    rows = results["matrix"]
    optimizers = list(dict.fromkeys(r["optimizer"] for r in rows))
    fig, axes = plt.subplots(1, len(optimizers), figsize=(4 * len(optimizers), 3.6), sharey=True)
    for ax, name in zip(axes, optimizers):
        for label in REDUCTIONS:
            for clipped, style in ((False, "-"), (True, "--")):
                pts = sorted((r["devices"], max(r["max_abs_dparam"], 1e-9)) for r in rows
                             if r["optimizer"] == name and r["reduction"] == label and r["clip"] == clipped)
                ax.plot(*zip(*pts), style, marker="o", label=f"{label}{' + clip' if clipped else ''}")
        ax.set(title=name, xlabel="devices N", xscale="log", yscale="log", xticks=[2, 4, 8], xticklabels=["2", "4", "8"])
    axes[0].set_ylabel("max |Δparam| vs 1 device")
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
