"""Flax in and out of the step: `jdp.bridges.nnx` (NNX modules, `task` for the trainer) and
`jdp.bridges.linen` (Linen modules and flax.training's TrainState).
"""
