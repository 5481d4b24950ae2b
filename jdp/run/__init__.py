"""The trainer: the config and its schema, the run's facts, the training loop, checkpoints, the
workdir lock, metrics, tasks, the agreement between processes, and the `jdp` command line.
"""
