"""A model's own sharding annotations (nnx.with_partitioning, Linen's boxes, made under jax.set_mesh) under every backend."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState as LinenTrainState
from jax.sharding import PartitionSpec as P

import jdp
import jdp.linen
import jdp.nnx
from tests.helpers import batches, max_abs_diff

DEV = jax.devices()[:4]
DATA = batches(2, 16, seed=4, sizes=(12, 16, 8))


class Net(nnx.Module):
    """Annotated as Flax's NNX examples annotate: each kernel's dimensions named after the model's mesh."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.l0 = nnx.Linear(12, 16, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.l1 = nnx.Linear(16, 8, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return self.l1(jnp.tanh(self.l0(x)))


def loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def model_mesh():
    return jax.make_mesh((2, 2), ("embed", "mlp"))  # the model's own mesh (Explicit axes, as jax.make_mesh makes)


def train_nnx(backend, **options):
    """Make the model under its mesh and train it there, as Flax's examples do; the step and its params."""
    with jax.set_mesh(model_mesh()):
        model = Net(nnx.Rngs(0))
        step = jdp.nnx.make_train_step(model, loss, optax.sgd(0.5), backend=backend, devices=DEV, **options)
        state = step.init()
        for batch in DATA:
            state, _ = step(state, batch)
    return state, jdp.get_params(state)


@pytest.fixture(scope="module")
def one_device():
    with jax.set_mesh(model_mesh()):
        model = Net(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.device_get(params)
    tx = optax.sgd(0.5)
    opt = tx.init(params)
    for batch in DATA:  # plain JAX on one device, no mesh
        grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest, copy=True), batch))(params)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    return jax.device_get(params)


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_annotations_are_set_aside_under_shard_map_and_pmap_and_said_once(backend, one_device, capsys):
    _, params = train_nnx(backend)
    assert max_abs_diff(params, one_device) <= 2e-6
    err = capsys.readouterr().err
    assert err.count("jdp: ") == 1
    assert (f"the params' sharding annotations (e.g. params['l0']['kernel'] ('embed', 'mlp')) are set aside under "
            f"backend={backend!r}, which keeps whole params on every device; backend='jit' honours them.") in err


def test_annotations_under_jit_map_through_axis_rules_and_the_rest_is_replicated(one_device, capsys):
    state, params = train_nnx("jit", axis_rules={"mlp": "data"})
    assert max_abs_diff(params, one_device) <= 2e-6
    assert state.params["l0"]["kernel"].sharding.spec == P(None, "data")  # ("embed", "mlp"): mlp over jdp's devices
    assert state.params["l1"]["kernel"].sharding.spec == P("data", None)
    assert state.params["l0"]["bias"].sharding.is_fully_replicated  # not annotated: jdp's replicated layout
    err = capsys.readouterr().err
    assert err.count("jdp: ") == 1
    assert "backend='jit' replicates the params' annotated axes 'embed', which its mesh {'data': 4} lacks" in err


def test_without_rules_jit_replicates_every_axis_its_mesh_lacks(one_device, capsys):
    state, params = train_nnx("jit", shard_params=True)
    assert max_abs_diff(params, one_device) <= 2e-6
    assert state.params["l0"]["kernel"].sharding.spec == P(None, "data")  # FSDP's split_dim, as unannotated
    assert "annotated axes 'embed', 'mlp', which its mesh {'data': 4} lacks" in capsys.readouterr().err


def test_a_linen_models_partitioned_params_run_under_jit_and_shard_map(capsys):
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.initializers.lecun_normal()
            x = jnp.tanh(nn.Dense(16, kernel_init=nn.with_partitioning(init, ("embed", "mlp")))(x))
            return nn.Dense(8, kernel_init=nn.with_logical_partitioning(init, ("hidden", "vocab")))(x)

    model = MLP()
    start = LinenTrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), jnp.zeros((1, 12)))[
        "params"], tx=optax.sgd(0.5))

    def linen_loss(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    ends = {}
    for backend, rules in (("shard_map", {}), ("jit", {"hidden": "data"})):
        step, state = jdp.linen.make_train_step(start, linen_loss, backend=backend, devices=DEV, **(
            {"axis_rules": rules} if rules else {}))
        for batch in DATA:
            state, _ = step(state, batch)
        ends[backend] = jdp.get_params(state)
    assert state.params["Dense_1"]["kernel"].sharding.spec == P("data", None)
    assert max_abs_diff(ends["jit"], ends["shard_map"]) <= 2e-6
    assert capsys.readouterr().err.count("jdp: ") == 2


@pytest.mark.parametrize("options,message", [
    (dict(backend="shard_map", axis_rules={"mlp": "data"}), "axis_rules maps the params' sharding annotations onto "
                                                           "the mesh, which only backend='jit' honours"),
    (dict(backend="jit", axis_rules={"mlp": "tensor"}), r"axis_rules maps 'mlp' to 'tensor'; map a sharding "
                                                        r"annotation's axis name \(a string\) to one of jdp's mesh "
                                                        r"axes \('data',\) or to None"),
])
def test_bad_axis_rules_are_one_sentence(options, message):
    with pytest.raises(ValueError, match=message):
        jdp.make_train_step(lambda p, b: jnp.sum(p["w"]), optax.sgd(0.1), **options)
