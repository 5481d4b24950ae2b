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


def test_gathered_makes_a_modules_split_params_whole_and_changes_nothing_else():
    """`jdp.fsdp.gathered`: an NNX module's copy, or a Linen module class, whose `Split` params are
    whole (one all-gather each, inside shard_map over 2 devices); without `Split` the same params;
    anything else refused in one sentence."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import linen as nn
    from flax import nnx
    from jax.sharding import Mesh, PartitionSpec as P

    from jdp.fsdp import Split, gathered

    model, x = nnx.Linear(4, 3, rngs=nnx.Rngs(0)), np.arange(8, dtype=np.float32).reshape(2, 4)
    graphdef, state = nnx.split(model)
    kernel, bias = np.asarray(model.kernel[...]), np.asarray(model.bias[...])
    copy = gathered(model)
    assert copy is not model and np.array_equal(copy.kernel[...], kernel)  # no Split: the same params
    linen_params = {"kernel": jnp.asarray(kernel), "bias": jnp.asarray(bias)}

    def whole(block):  # this device's (2, 3) rows of the kernel, as per-layer FSDP hands them to the model
        split = jax.tree.map(lambda v: Split(block, dim=-2, axis="d") if v.shape == (4, 3) else v, state)
        nnx_out = gathered(nnx.merge(graphdef, split))(x)
        params = {"kernel": Split(block, dim=-2, axis="d"), "bias": linen_params["bias"]}
        return nnx_out, gathered(nn.Dense)(3).apply({"params": params}, x)

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    outs = jax.jit(jax.shard_map(whole, mesh=mesh, in_specs=P("d"), out_specs=P(), check_vma=False))(kernel)
    for out in outs:
        np.testing.assert_allclose(out, x @ kernel + bias, rtol=1e-6)
    with pytest.raises(ValueError, match=r"^gathered takes a Flax NNX module or a Flax Linen module class, got 3 "):
        gathered(3)
