"""jdp's example scripts, shipped in the package: each runs as `python -m jdp.examples.NAME`
(in a checkout, `examples/` links here, so `python examples/NAME.py` runs the same file).

`python -m jdp.examples` lists them with the folder that holds them, for the two launch scripts
(`launch_local.sh`, `launch_slurm.sh`) and the test file to copy (`test_my_model.py`).
"""
