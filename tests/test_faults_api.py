"""API misuse the step refuses in one sentence, and updates that go non-finite without a NaN gradient."""
import jax
import numpy as np
import optax
import pytest

import jdp
from helpers import batches, max_abs_diff, mlp_loss, mlp_params


@pytest.fixture(scope="module")
def sgd_step():
    return jdp.make_train_step(mlp_loss, optax.sgd(0.1), devices=jax.devices()[:4], mask_key="mask")


def test_reusing_a_donated_state_raises_instead_of_crashing(sgd_step):
    state = sgd_step.init(mlp_params())
    (batch,) = batches(1, 16)
    sgd_step(state, batch)  # donates `state`: its buffers now belong to the returned state
    with pytest.raises(ValueError, match="state was donated to an earlier call .* use the state that call returned"):
        sgd_step(state, batch)


def test_empty_batch_is_refused(sgd_step):
    (batch,) = batches(1, 16)
    empty = {k: v[:0] for k, v in batch.items()}
    with pytest.raises(ValueError, match=r"the global batch is empty \(0 examples\)"):
        sgd_step(sgd_step.init(mlp_params()), empty)


def test_all_padding_batch_is_refused(sgd_step):
    (batch,) = batches(1, 16)
    with pytest.raises(ValueError, match=r"batch\['mask'\] marks no real example \(all zeros\)"):
        sgd_step(sgd_step.init(mlp_params()), {**batch, "mask": np.zeros(16, np.float32)})


def test_devices_as_ids_are_accepted_and_bad_ones_refused():
    by_id = jdp.make_train_step(mlp_loss, optax.sgd(0.1), devices=[0, 1])
    assert by_id.devices == jax.devices()[:2]
    with pytest.raises(ValueError, match=r"device id 99 does not exist; the ids are \[0, 1, 2"):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), devices=[0, 99])
    with pytest.raises(ValueError, match=r"devices holds 'cpu:0' \(str\); give jax.Device objects or their integer ids"):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), devices=["cpu:0"])


@pytest.mark.parametrize("accum", [(1, "every"), (2, "every"), (2, "last")])
def test_finite_gradient_that_makes_params_nan_is_skipped(accum):
    """Adam with ε = 0 divides 0 by 0 for a parameter whose gradient is exactly 0: the gradient is
    finite, the new params are not. skip_nonfinite must treat that update like a NaN gradient."""
    def loss(params, batch):  # "unused" never reaches the loss: its gradient is exactly 0
        return mlp_loss({k: v for k, v in params.items() if k != "unused"}, batch) + 0.0 * params["unused"].sum()

    params = {**mlp_params(), "unused": np.ones(3, np.float32)}
    m, sync = accum
    data = batches(2, 16, seed=3)
    run = {}
    for skip in (False, True):
        step = jdp.make_train_step(loss, optax.adam(1e-2, eps=0.0), devices=jax.devices()[:4], accum_steps=m,
                                   accum_sync=sync, skip_nonfinite=skip)
        state = step.init(params)
        for batch in data:
            for micro in step.micro_batches(batch):
                state, metrics = step(state, micro)
        run[skip] = (jdp.get_params(state), jax.device_get(metrics), int(jdp.step.get_tree(state, state.skipped)))
    assert np.isnan(run[False][0]["unused"]).all()  # without the guard the run is poisoned
    params_after, metrics, skipped = run[True]
    assert skipped == len(data) and bool(metrics["skipped"]) and int(metrics["skip_streak"]) == len(data)
    assert max_abs_diff(params_after, params) == 0.0  # every update was refused: nothing changed
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params_after))



def test_an_integer_leaf_in_params_is_named_with_where_it_belongs(sgd_step):
    params = {**mlp_params(), "counter": np.zeros((), np.int32)}
    with pytest.raises(ValueError, match=r"params\['counter'\] is int32, .*keep non-trainable values .* in the "
                                         r"model state \(has_state=True"):
        sgd_step.init(params)


@pytest.mark.parametrize("wrapped", [optax.MultiSteps(optax.sgd(0.1), 2),
                                     optax.MultiSteps(optax.sgd(0.1), 2).gradient_transformation()],
                         ids=["MultiSteps", "gradient_transformation"])
def test_an_optimizer_in_multisteps_with_accum_steps_is_refused_naming_both(wrapped):
    step = jdp.make_train_step(mlp_loss, wrapped, devices=jax.devices()[:2], accum_steps=2)
    with pytest.raises(ValueError, match=r"the optimizer is an optax.MultiSteps, .* and accum_steps=2 accumulates "
                                         r"too"):
        step.init(mlp_params())


def test_an_optimizer_that_needs_the_loss_as_value_is_refused_in_one_sentence():
    plateau = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau())
    step = jdp.make_train_step(mlp_loss, plateau, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"the optimizer's update needs arguments besides \(updates, state, params\) "
                                         r"\(.*'value'.*\), such as optax.contrib.reduce_on_plateau's value=loss"):
        step.init(mlp_params())


def test_restoring_another_optimizers_checkpoint_names_the_structure_and_keeps_it(tmp_path, sgd_step):
    adam = jdp.make_train_step(mlp_loss, optax.adam(0.1), devices=jax.devices()[:4])
    jdp.save_state(str(tmp_path), adam, adam.init(mlp_params()))
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(jdp.run.checkpoint.CheckpointMismatchError) as error:
        jdp.restore_state(str(tmp_path), sgd_step, sgd_step.init(mlp_params()))
    message = str(error.value)
    assert "holds an optimizer state of another structure (checkpoint: 0.count ()" in message
    assert "this step: no arrays" in message and "remove" not in message
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == files


def test_a_nonfinite_model_state_is_never_saved(tmp_path):
    # Finite params and optimizer state, NaN running statistics: no checkpoint is written.
    from jdp.run.checkpoint import NonFiniteStateError

    step = jdp.make_train_step(lambda params, stats, batch: (mlp_loss(params, batch), stats), optax.sgd(0.1),
                               devices=jax.devices()[:2], has_state=True, sync_batchnorm=False)
    state = step.init(mlp_params(), {"mean": np.array([0.0, np.nan], np.float32)})
    with pytest.raises(NonFiniteStateError, match=r"first in model_state\['mean'\]\), so it was not checkpointed"):
        jdp.save_state(str(tmp_path / "ckpt"), step, state)
    assert not any(p.is_dir() and p.name.isdigit() for p in tmp_path.rglob("*"))
