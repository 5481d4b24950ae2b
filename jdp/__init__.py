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
from jdp import cpu
from jdp.core.mesh import DATA_AXIS, make_mesh
from jdp.core.optim import OptimizerSpec, exact_sum_spec
from jdp.core.options import StepOptions
from jdp.core.state import TrainState
from jdp.core.step import TrainStep, get_params, make_train_step
from jdp.core.weighting import Weighted
from jdp.inspect.comm import CommReport, comm_report
from jdp.inspect.memory import MemoryReport, memory_report
from jdp.inspect.replicas import ReplicaMismatchError, check_replicas, replica_mismatches

__version__ = "0.1.0"

# Before jax starts its CPU backend: size the thread pool for the fake devices (see jdp/cpu.py). A bad
# JDP_CPU_THREADS does not fail the import (the CLI could not report it without a traceback): every
# step refuses it.
cpu.configure_at_import()

# Imported on first use: orbax (checkpoints), flax.training (Linen) and grain (data) cost ~0.3 s each.
# The public modules (jdp.nnx, jdp.zero, ...) too: each re-exports its subpackage's module, which
# the names above do not need.
_LAZY = {"restore_state": "jdp.run.checkpoint", "save_state": "jdp.run.checkpoint", "data": None, "linen": None,
         "models": None, "nnx": None, "zero": None, "fsdp": None, "step": None, "train": None, "config": None,
         "testing": None}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'jdp' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(_LAZY[name] or f"jdp.{name}")
    return module if _LAZY[name] is None else getattr(module, name)


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
