"""jdp: a small, exact JAX data-parallel trainer.

N devices each take the mean loss over their shard, all-reduce-average the gradients, and take
exactly the step one device would take on the whole global batch.
"""
from jdp import cpu
from jdp.comm import CommReport, comm_report
from jdp.optim import OptimizerSpec, exact_sum_spec
from jdp.mesh import DATA_AXIS, batch_sharded, make_mesh, replicated
from jdp.reduce import mean_over_devices, reduce_step_values, sum_over_devices
from jdp.replicas import ReplicaMismatchError, check_replicas, replica_mismatches
from jdp.state import LocalAccum, TrainState, device_key
from jdp.step import TrainStep, get_params, get_tree, make_train_step

__version__ = "0.1.0"

# Before jax starts its CPU backend: size the thread pool for the fake devices (see jdp/cpu.py).
cpu.configure_cpu_threads()

__all__ = [
    "CommReport", "DATA_AXIS", "comm_report", "OptimizerSpec", "exact_sum_spec", "ReplicaMismatchError", "TrainState", "TrainStep", "batch_sharded", "check_replicas",
    "device_key", "get_params", "get_tree", "make_mesh", "make_train_step", "mean_over_devices",
    "reduce_step_values", "LocalAccum", "replica_mismatches", "replicated", "sum_over_devices",
]
