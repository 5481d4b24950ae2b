"""Any optax optimizer as written under ZeRO-1 and FSDP: clipping by the whole gradient's norm, a weight-decay
mask by ndim, adafactor's factored moments, exact against one device on the global batch."""
import functools

import jax
import numpy as np
import optax
import pytest

import jdp
from tests.helpers import batches, max_abs_diff, mlp_loss, mlp_params, reference_grad_norms, reference_run
from tests.helpers import SHARDED_GLOBAL as GLOBAL, SHARDED_TOL as TOL

DATA = batches(6, GLOBAL)
AS_WRITTEN = {  # what language-model codebases write: no decay on biases and norms, clipping first
    "clip_adamw_mask": lambda: optax.chain(optax.clip_by_global_norm(0.6), optax.adamw(
        1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
}
LAYOUTS = {"zero1": {"shard_optimizer_state": True}, "fsdp": {"shard_params": True}}


@functools.lru_cache(maxsize=None)
def one_device(name, accum_steps=1):
    joined = [{k: np.concatenate([b[k] for b in DATA[i:i + accum_steps]]) for k in DATA[0]}
              for i in range(0, len(DATA), accum_steps)]
    return reference_run(mlp_loss, AS_WRITTEN[name](), mlp_params(), joined)[0]


def run(n, name, layout, **options):
    step = jdp.make_train_step(mlp_loss, AS_WRITTEN[name](), devices=jax.devices()[:n], **LAYOUTS[layout], **options)
    state = step.init(mlp_params())
    for batch in DATA:
        state, _ = step(state, batch)
    return step, state


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", AS_WRITTEN)
def test_optimizer_as_written_equals_one_device(name, layout):
    want = one_device(name)
    assert max_abs_diff(want, mlp_params()) > 1e3 * TOL  # the params moved far more than TOL
    for n in (2, 8):
        step, state = run(n, name, layout)
        assert max_abs_diff(jdp.get_params(state), want) <= TOL
        assert step.layout.gathered == []  # every part of the update ran on the blocks, none on gathered values
        # checkpoints are the replicated step's: the optimizer state in its own shapes, replicated
        canonical = step.canonical(state)
        whole = jax.device_get(jdp.make_train_step(mlp_loss, AS_WRITTEN[name](), devices=jax.devices()[:1]).init(
            mlp_params()).opt_state)
        assert [np.shape(x) for x in jax.tree.leaves(canonical.opt_state)] == [np.shape(x) for x in
                                                                                jax.tree.leaves(whole)]
        assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(canonical.opt_state))


def test_clipping_engages_on_some_steps_only():
    norms = reference_grad_norms(mlp_loss, AS_WRITTEN["clip_adamw_mask"](), mlp_params(), DATA)
    assert min(norms) < 0.6 < max(norms)  # the clip test above sees both branches of clipping


@pytest.mark.parametrize("accum_sync", ["every", "last"])
def test_optimizer_as_written_with_accumulation(accum_sync):
    _, state = run(4, "clip_adamw_mask", "fsdp", accum_steps=2, accum_sync=accum_sync)
    assert max_abs_diff(jdp.get_params(state), one_device("clip_adamw_mask", 2)) <= TOL


def test_split_layout_of_the_state():
    step, state = run(8, "adafactor", "zero1")
    leaves = dict(zip([jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(mlp_params())],
                      jax.tree.leaves(jdp.zero.Cuts(mlp_params(), 8).dims)))
    # (12, 16) splits along 16, (16, 5) along 16, the bias of 5 on no dimension
    assert leaves["['l0']['w']"] == 1 and leaves["['l2']['w']"] == 0 and leaves["['l2']['b']"] == -1
    # adafactor's factored moments (a row and a column vector per matrix) are shaped unlike the params: replicated
    shapes = {x.sharding.is_fully_replicated for x in jax.tree.leaves(state.opt_state) if np.ndim(x) == 1}
    assert shapes == {True, False}  # the factored vectors replicated, the unfactored bias moments of 16 split


MATRICES = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
PARTITIONED = {  # optimizers whose state leaves optax.MaskedNode where a param is not theirs
    "masked": lambda: optax.masked(optax.adam(1e-2), MATRICES),
    "multi_transform": lambda: optax.multi_transform(
        {"matrix": optax.adam(1e-2), "vector": optax.sgd(0.3)},
        lambda p: jax.tree.map(lambda x: "matrix" if x.ndim > 1 else "vector", p)),
    # Newton–Schulz on each whole matrix (adam for the rest): its iterations, a lax.scan, run on the
    # gathered matrices, exactly
    "muon": lambda: optax.contrib.muon(1e-2),
}


@functools.lru_cache(maxsize=None)
def partitioned_run(name, n, **layout):
    step = jdp.make_train_step(mlp_loss, PARTITIONED[name](), devices=jax.devices()[:n], **layout)
    state = step.init(mlp_params())
    for batch in DATA:
        state, _ = step(state, batch)
    return step, state


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", PARTITIONED)
def test_masked_partitioned_and_muon_equal_one_device(name, layout):
    """optax.masked, optax.multi_transform and optax.contrib.muon under ZeRO-1 and FSDP: the replicated
    step's params and one device's, the state in its own structure (MaskedNode and all)."""
    want = reference_run(mlp_loss, PARTITIONED[name](), mlp_params(), DATA)[0]
    assert max_abs_diff(want, mlp_params()) > 1e3 * TOL
    step, state = partitioned_run(name, 4, **LAYOUTS[layout])
    replicated = jdp.get_params(partitioned_run(name, 4)[1])
    for got, one, rep in zip(*map(jax.tree.leaves, (jdp.get_params(state), want, replicated))):
        np.testing.assert_allclose(got, one, atol=TOL, rtol=0)
        np.testing.assert_allclose(got, rep, atol=TOL, rtol=0)
    assert set(step.layout.gathered) <= ({"scan"} if name == "muon" else set())
    whole = jdp.make_train_step(mlp_loss, PARTITIONED[name](), devices=jax.devices()[:1]).init(mlp_params()).opt_state
    canonical = step.canonical(state).opt_state
    assert jax.tree.structure(canonical) == jax.tree.structure(whole)
    assert [np.shape(x) for x in jax.tree.leaves(canonical)] == [np.shape(x) for x in jax.tree.leaves(whole)]
    # the moments of the matrices are split (4 divides 16), not left whole on every device
    dims = jax.tree.leaves(step.layout.opt_dims)
    assert dims.count(1) >= 2 and all(not x.sharding.is_fully_replicated for x, d in zip(
        jax.tree.leaves(state.opt_state), dims) if d != -1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["masked", "muon"])
def test_masked_and_muon_under_jit_equal_one_device(name, layout):
    """The global view lays optax.masked's and muon's state out by the state's paths (MaskedNode where
    a param is not theirs): it trains as written, one device's step, the moments split."""
    want = reference_run(mlp_loss, PARTITIONED[name](), mlp_params(), DATA)[0]
    step, state = partitioned_run(name, 4, backend="jit", **LAYOUTS[layout])
    for got, one in zip(*map(jax.tree.leaves, (jdp.get_params(state), want))):
        np.testing.assert_allclose(got, one, atol=TOL, rtol=0)
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state.opt_state))
