"""Flax in and out of the step and the trainer: `jdp.bridges.nnx` (NNX modules; `task` for the
trainer), `jdp.bridges.linen` (Linen modules and flax.training's TrainState), `jdp.bridges.gathered` (a
module's params made whole inside per-layer FSDP: `jdp.fsdp.gathered`), and `jdp.bridges.task`
(`Task`: a model and its data in the form the trainer consumes).
"""
