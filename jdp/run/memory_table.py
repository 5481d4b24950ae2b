"""`jdp memory CONFIG`: bytes per device of a config's step in each layout, without training."""
from __future__ import annotations

import time

from jdp.run.config import Config, apply_overrides
from jdp.run.tasks import build_task, train_step_for

# Each layout's keys over the config's; parallel.replicas (hybrid sharding) applies to the sharded ones.
LAYOUTS = {"replicated": ["parallel.shard_optimizer_state=false", "parallel.shard_params=false",
                          "parallel.replicas=1"],
           "ZeRO-1": ["parallel.shard_optimizer_state=true", "parallel.shard_params=false"],
           "FSDP": ["parallel.shard_optimizer_state=true", "parallel.shard_params=true"]}


def memory_table(config: Config, devices, fsdp_extra: list[str] = (), say=None) -> list[dict]:
    """One row per layout (replicated, ZeRO-1, FSDP; FSDP gathers per layer for a scanned GPT): the
    state between steps and the compiled step's peak, bytes per device (`jdp.memory_report`), for
    the config's model, optimizer and micro-batch on `devices`; `fsdp_extra`: overrides of the FSDP
    row only (`jdp train`'s per-layer defaults, `fsdp_layer_defaults`). Compiles each step; runs none.
    `say(line)` hears what it is doing as it goes (`progress_line`): each step it compiles, with the
    seconds since it started (a large model's three compilations take minutes)."""
    from jdp.inspect.memory import memory_report

    start, say = time.perf_counter(), say or (lambda line: None)
    names = [n for n in LAYOUTS if config.parallel.backend != "pmap" or n == "replicated"]  # pmap: whole copies
    say(progress_line(0.0, model=config.model.name))
    task, rows = build_task(config), []
    first = first_batch(config, task)
    for i, name in enumerate(names):
        say(progress_line(time.perf_counter() - start, layout=name, number=i + 1, total=len(names)))
        row = apply_overrides(config, [*LAYOUTS[name], *(fsdp_extra if name == "FSDP" else ())])
        row_task = build_task(row) if row.model.sync_batchnorm else task  # BatchNorm's axes follow the groups
        step = train_step_for(row, row_task, devices)
        state = step.init(row_task.params, row_task.model_state, seed=config.train.seed)
        report = memory_report(step, state, step.micro_batches(first)[0])
        rows.append({"layout": name, "how": report.layout, "state": report.state, "peak": report.allocated})
    say(progress_line(time.perf_counter() - start, total=len(names)))
    return rows


def first_batch(config: Config, task):
    """The first global batch `jdp train` would take from `task`'s training data under `config` (this process's rows)."""
    import jax

    from jdp.data import make_batches

    batches = make_batches(task.train, config.data.batch_size, seed=config.train.seed, transform=task.transform,
                           process_index=jax.process_index(), num_processes=jax.process_count())
    try:
        return next(batches)
    finally:
        batches.close()


def compiled_peak(config: Config, devices) -> int | None:
    """Bytes per device of the compiled step's peak (`jdp.memory_report(...).allocated`) for `config`'s
    model, layout and first micro-batch on `devices`: compiled, not run. None where XLA gives no
    memory analysis."""
    from jdp.inspect.memory import memory_report

    task = build_task(config)
    first = first_batch(config, task)
    step = train_step_for(config, task, devices)
    state = step.init(task.params, task.model_state, seed=config.train.seed)
    return memory_report(step, state, step.micro_batches(first)[0]).allocated


def progress_line(seconds: float, model: str | None = None, layout: str | None = None, number: int = 0,
                  total: int = 0) -> str:
    """The line `jdp memory` prints `seconds` after it began: as it builds `model`'s task, as it starts
    compiling `layout`'s step (number `number` of `total`), or, with neither, once all `total` are compiled."""
    if model is not None:
        return f"jdp memory: building the {model} model and its first batch ({seconds:.1f} s so far)"
    if layout is not None:
        return f"jdp memory: compiling the {layout} step, {number} of {total} ({seconds:.1f} s so far)"
    return f"jdp memory: {total} step(s) compiled in {seconds:.1f} s"


def render(rows: list[dict], devices: int) -> str:
    out = [f"bytes per device on {devices} device(s): state between steps, and the compiled step's peak "
           f"(arguments + outputs - aliased + temporaries)", f"{'layout':<12}{'state':>16}{'peak':>16}  how"]
    for r in rows:
        out.append(f"{r['layout']:<12}{r['state']:>16,}{(r['peak'] or 0):>16,}  {r['how']}")
    return "\n".join(out)
