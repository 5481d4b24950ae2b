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


class ExplicitNet(nnx.Module):
    """Written for an Explicit mesh of its own axis names, as Flax's NNX language model example is: its
    kernels annotated ("rows", "cols"), its activations' shardings named in its own code."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.l0 = nnx.Linear(12, 16, kernel_init=nnx.with_partitioning(init, ("rows", "cols")), rngs=rngs)
        self.l1 = nnx.Linear(16, 8, kernel_init=nnx.with_partitioning(init, ("cols", "rows")), rngs=rngs)

    def __call__(self, x):
        return self.l1(jnp.tanh(self.l0(x, out_sharding=P("rows", "cols"))), out_sharding=P("rows", None))


def train_explicit(mesh, **options):
    """Made under `jax.set_mesh(mesh)`, trained through jdp on that mesh (`mesh=`); the calls outside
    the context, as the step sets the mesh itself (the model's code reads it from the context)."""
    with jax.set_mesh(mesh):
        model = ExplicitNet(nnx.Rngs(0))
        step = jdp.nnx.make_train_step(model, loss, optax.sgd(0.5), backend="jit", mesh=mesh, **options)
    state = step.init()
    for micro in DATA:
        state, _ = step(state, micro)
    return state, jdp.get_params(state)


@pytest.fixture(scope="module")
def explicit_one_device():
    """The model's own step, jitted, on one device under a 1×1 mesh of its axis names."""
    mesh = jax.make_mesh((1, 1), ("rows", "cols"), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        model = ExplicitNet(nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        tx = optax.sgd(0.5)
        opt = tx.init(params)

        @jax.jit
        def step(params, opt, batch):
            grads = jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest, copy=True), batch))(params)
            updates, opt = tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt

        for batch in DATA:
            params, opt = step(params, opt, batch)
    return jax.device_get(params)


@pytest.mark.parametrize("options", [{}, {"shard_params": True}], ids=["jit", "jit-fsdp"])
def test_a_model_for_an_explicit_mesh_of_its_own_axis_names_runs_on_it_under_jit(options, explicit_one_device,
                                                                                 capsys):
    mesh = jax.make_mesh((4, 1), ("rows", "cols"), devices=DEV)  # Explicit axes, as jax.make_mesh makes them
    state, params = train_explicit(mesh, **options)
    np.testing.assert_allclose(params["l0"]["kernel"], explicit_one_device["l0"]["kernel"], rtol=0, atol=2e-6)
    assert max_abs_diff(params, explicit_one_device) <= 2e-6
    kernel = state.params["l0"]["kernel"]
    assert kernel.sharding.mesh == mesh and kernel.sharding.spec == P("rows", "cols")  # its annotation, as written
    assert state.params["l0"]["bias"].sharding.is_fully_replicated  # not annotated: whole, its type unchanged
    said = capsys.readouterr().err
    assert said.count("jdp: ") == len(options)
    assert ("add no split of their own" in said) == bool(options)


@pytest.mark.parametrize("options,message", [
    (dict(backend="shard_map"), "mesh= runs the step on the caller's mesh, which only backend='jit' does"),
    (dict(backend="jit", devices=DEV[:2]), r"devices \[0, 1\] are not the mesh's devices \[0, 1, 2, 3\]"),
    (dict(backend="jit", replicas=2, shard_params=True), "give either replicas or mesh, not both"),
])
def test_a_mesh_jdp_cannot_run_on_is_refused_in_one_sentence(options, message):
    mesh = jax.make_mesh((4, 1), ("rows", "cols"), devices=DEV)
    with pytest.raises(ValueError, match=message):
        jdp.make_train_step(lambda p, b: jnp.sum(p["w"]), optax.sgd(0.1), mesh=mesh, **options)


def test_a_mesh_with_two_wide_axes_needs_the_batch_axis_named():
    mesh = jax.make_mesh((2, 2), ("rows", "cols"), devices=DEV)
    with pytest.raises(ValueError, match=r"mesh \{'rows': 2, 'cols': 2\} has several axes of more than one device "
                                         r"and none is axis_name='data'; name the axis the batch is split over"):
        jdp.make_train_step(lambda p, b: jnp.sum(p["w"]), optax.sgd(0.1), backend="jit", mesh=mesh)
    step = jdp.make_train_step(lambda p, b: jnp.sum(p["w"]), optax.sgd(0.1), backend="jit", mesh=mesh,
                               axis_name="cols")
    assert step.layout.batch.spec == P("cols")


def test_on_a_callers_auto_mesh_shard_params_splits_the_unannotated_leaves_too(one_device):
    """Auto axes (`Mesh(devices, names)`): the partitioner places everything, so jdp's FSDP split of the
    leaves the annotations leave whole is free to add; the batch goes over the one axis of 4 devices."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(DEV).reshape(4, 1), ("mlp", "embed"))
    with jax.set_mesh(model_mesh()):
        model = Net(nnx.Rngs(0))
    step = jdp.nnx.make_train_step(model, loss, optax.sgd(0.5), backend="jit", mesh=mesh, shard_params=True)
    state = step.init()
    for batch in DATA:
        state, _ = step(state, batch)
    assert max_abs_diff(jdp.get_params(state), one_device) <= 2e-6
    assert step.layout.batch.spec == P("mlp")
    assert state.params["l0"]["kernel"].sharding.spec == P("embed", "mlp")  # its annotation, on this mesh
    assert state.params["l0"]["bias"].sharding.spec == P("mlp")  # unannotated: FSDP's split_dim


def test_a_model_that_names_its_own_meshs_axes_on_jdps_mesh_is_told_to_pass_mesh():
    mesh = jax.make_mesh((4, 1), ("rows", "cols"), devices=DEV)
    with jax.set_mesh(mesh):
        model = ExplicitNet(nnx.Rngs(0))
        step = jdp.nnx.make_train_step(model, loss, optax.sgd(0.5), backend="jit", devices=DEV)  # no mesh=
        state = step.init()
        with pytest.raises(ValueError, match=r"the model names the mesh axis 'rows', which the step's mesh "
                                             r"\{'data': 4\} lacks; run the step on the mesh the model was written "
                                             r"for with make_train_step\(\.\.\., backend='jit', mesh=that_mesh\)\."):
            step(state, DATA[0])


def test_init_can_be_traced_for_the_states_shapes():
    """`jax.eval_shape(step.init, params)`: the state's shapes without computing it (benchmarks/gpu_parts.py
    compiles a large model's step from them). A traced params value has no sharding for the check of
    params made on another mesh to read."""
    from tests.helpers import mlp_loss, mlp_params

    step = jdp.make_train_step(mlp_loss, optax.adam(1e-2), devices=jax.devices()[:2])
    shapes = jax.eval_shape(step.init, mlp_params())
    assert jax.tree.map(np.shape, shapes.params) == jax.tree.map(np.shape, mlp_params())
