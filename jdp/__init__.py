"""jdp: a small, exact JAX data-parallel trainer.

N devices each take the mean loss over their shard, all-reduce-average the gradients, and take
exactly the step one device would take on the whole global batch; a weighted loss (`Weighted`: a
sum over tokens and their count) is divided once by the global weight, so the step is exact per token.

The public API is what this module exports, and the public modules `jdp.nnx`, `jdp.linen`,
`jdp.train`, `jdp.config`, `jdp.testing`, `jdp.zero`, `jdp.fsdp`, `jdp.step`, `jdp.cpu`, `jdp.data`
and `jdp.models`. The implementation is grouped by concern: `jdp.core` (the step), `jdp.bridges`
(Flax NNX and Linen), `jdp.data` (the input pipeline), `jdp.run` (the trainer and `jdp train`),
`jdp.inspect` (explain, reports, the exactness check) and `jdp.models`.
"""
from jdp import cpu  # without jax: it imports jax where it is used

__version__ = "0.1.0"

# Before jax starts its CPU backend: size the thread pool for the fake devices (see jdp/cpu.py). A bad
# JDP_CPU_THREADS does not fail the import (the CLI could not report it without a traceback): every
# step refuses it.
cpu.configure_at_import()

# Every other public name is imported on first use, so that `import jdp` does not import jax (the
# `jdp` command answers --version and --help at once): the step, reports and replica check import
# jax, orbax (checkpoints), flax.training (Linen) and grain (data) cost ~0.3 s each. The public
# modules (jdp.nnx, jdp.zero, ...) each re-export their subpackage's module.
_LAZY = {"DATA_AXIS": "jdp.core.mesh", "make_mesh": "jdp.core.mesh", "OptimizerSpec": "jdp.core.optim",
         "exact_sum_spec": "jdp.core.optim", "StepOptions": "jdp.core.options", "TrainState": "jdp.core.state",
         "TrainStep": "jdp.core.step", "get_params": "jdp.core.step", "make_train_step": "jdp.core.step",
         "Weighted": "jdp.core.weighting",
         "CommReport": "jdp.inspect.comm", "comm_report": "jdp.inspect.comm", "MemoryReport": "jdp.inspect.memory",
         "memory_report": "jdp.inspect.memory", "ReplicaMismatchError": "jdp.inspect.replicas",
         "check_replicas": "jdp.inspect.replicas", "replica_mismatches": "jdp.inspect.replicas",
         "restore_state": "jdp.run.checkpoint", "save_state": "jdp.run.checkpoint", "data": None, "linen": None,
         "models": None, "nnx": None, "zero": None, "fsdp": None, "step": None, "train": None, "config": None,
         "testing": None,
         # The implementation's groups, reachable as attributes as when `import jdp` imported them all.
         "core": None, "bridges": None, "inspect": None, "run": None, "extras": None, "text": None}
# What `import jdp` used to import: a group reached as an attribute (`jdp.inspect.comm`) holds them.
_SURFACE = ("jdp.core.step", "jdp.core.optim", "jdp.inspect.comm", "jdp.inspect.memory", "jdp.inspect.replicas")


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'jdp' has no attribute {name!r}")
    import importlib

    for surface in _SURFACE if name in ("core", "inspect") else ():
        importlib.import_module(surface)
    module = importlib.import_module(_LAZY[name] or f"jdp.{name}")
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "CommReport",
    "DATA_AXIS",
    "MemoryReport",
    "OptimizerSpec",
    "ReplicaMismatchError",
    "StepOptions",
    "TrainState",
    "TrainStep",
    "Weighted",
    "check_replicas",
    "comm_report",
    "cpu",
    "data",
    "exact_sum_spec",
    "fsdp",
    "get_params",
    "linen",
    "make_mesh",
    "make_train_step",
    "memory_report",
    "models",
    "nnx",
    "replica_mismatches",
    "restore_state",
    "save_state",
    "zero",
]
