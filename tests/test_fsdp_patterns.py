"""Your own scanned model under per-layer FSDP (examples/fsdp_own_model.py): a Flax NNX stack with
nnx.scan/nnx.remat and a Flax Linen stack with nn.scan/nn.remat, each gathering one layer inside the scan
body, equal one device; the loop holds the gathers and reduce-scatters. The example script itself runs
in tests/test_examples.py."""
import importlib.util
import pathlib

import pytest

import jdp
from tests.helpers import max_abs_diff

PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "fsdp_own_model.py"
_spec = importlib.util.spec_from_file_location("fsdp_own_model", PATH)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)  # the models and runs as the example defines them (its __main__ not run)
PER_LAYER = 4  # each layer: two Linear/Dense layers' kernel and bias


@pytest.mark.parametrize("run", [example.nnx_run, example.linen_run], ids=["nnx", "linen"])
def test_scanned_model_gathers_per_layer_and_equals_one_device(run):
    _, one = run(1)
    step, sharded = run(4, shard_params=True, gather_in_model=True)
    assert max_abs_diff(jdp.get_params(sharded), jdp.get_params(one)) <= 3e-7
    inside = example.in_the_loop(step, sharded)
    assert inside.count("reduce-scatter") == PER_LAYER and inside.count("all-gather") >= PER_LAYER
