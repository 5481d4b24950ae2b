"""The step: options, the algorithm (grad -> reduce -> accumulate -> update), the reductions, the
layouts (shard_map, pmap, ZeRO-1, FSDP), precision, the state, the mesh, optimizer specs, and
`make_train_step` with the `TrainStep` it returns.
"""
