"""The training loop: data -> step -> logging -> evaluation -> checkpoint, in one readable function.

The public name of `jdp.run.train`, where it is implemented; import it as `jdp.train`.
"""
from jdp.run.train import (DataStoppedError, EvaluationOutOfMemoryError, NonFiniteError, StopSignals, TrainResult, itstime,
                           load_metrics, meant_for_accelerators, plot_metrics, schedule_facts, step_params, train)

__all__ = ["DataStoppedError", "EvaluationOutOfMemoryError", "NonFiniteError", "StopSignals", "TrainResult", "itstime", "load_metrics",
           "meant_for_accelerators", "plot_metrics", "schedule_facts", "step_params", "train"]
