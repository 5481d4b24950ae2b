"""Hybrid sharding (`replicas=R`): the state split over the G = N/R devices of each replica group and
replicated across the groups, as PyTorch FSDP's HYBRID_SHARD. The same step as one device; the
gradient is reduce-scattered within a group and its blocks all-reduced across the groups."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jdp
from jdp.zero import split_dim
from tests.helpers import batches, max_abs_diff, mlp_loss, mlp_params
from tests.helpers import SHARDED_GLOBAL as GLOBAL
from tests.helpers import SHARDED_OPTIMIZERS as OPTIMIZERS, SHARDED_TOL as TOL

DATA = batches(8, GLOBAL)
LAYOUTS = {"fsdp": {"shard_params": True}, "zero1": {"shard_optimizer_state": True}}


@functools.lru_cache(maxsize=None)
def run(n, name, steps=3, layout=None, **options):
    """`steps` optimizer steps of the MLP on n devices, shared by the tests below (compiling dominates)."""
    step = jdp.make_train_step(mlp_loss, OPTIMIZERS[name], devices=jax.devices()[:n],
                               **(LAYOUTS[layout] if layout else {}), **options)
    state = step.init(mlp_params())
    for batch in DATA[:steps * step.accum_steps]:
        state, metrics = step(state, batch)
    return step, state, metrics


@pytest.mark.parametrize("name,layout,replicas,accum", [
    ("sgd", "fsdp", 2, None), ("adamw_clip", "fsdp", 2, None), ("sgd", "fsdp", 4, None), ("sgd", "zero1", 2, None),
    ("adamw_clip", "fsdp", 2, "every"), ("sgd", "fsdp", 2, "last")])
def test_hybrid_sharding_equals_one_device(name, layout, replicas, accum):
    # SGD shows any error in the gradient's scale (a group's half of it, the norm counted twice);
    # AdamW with clipping at 0.6 (engaging on some steps) runs optax's chain as written on the blocks.
    accum_options = {} if accum is None else {"accum_steps": 2, "accum_sync": accum}
    _, one, one_metrics = run(1, name, **accum_options)
    assert max_abs_diff(jdp.get_params(one), mlp_params()) > 1e3 * TOL  # the params moved far more than TOL
    step, state, metrics = run(8, name, layout=layout, replicas=replicas, **accum_options)
    assert max_abs_diff(jdp.get_params(state), jdp.get_params(one)) <= TOL
    for a, b in zip(jax.tree.leaves(step.canonical(state).opt_state), jax.tree.leaves(one.opt_state)):  # SGD: none
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=TOL)
    np.testing.assert_allclose(metrics["grad_norm"], one_metrics["grad_norm"], rtol=1e-6)
    np.testing.assert_allclose(metrics["loss"], one_metrics["loss"], rtol=1e-6)
    jdp.check_replicas(state)  # every group's copy of every block is the same, bit for bit


def test_blocks_are_split_within_a_group_and_copied_across_groups():
    step, state, _ = run(8, "sgd", layout="fsdp", replicas=2)
    assert step.mesh.axis_names == ("replica", "shard") and step.mesh.devices.shape == (2, 4)
    for leaf, kept in zip(jax.tree.leaves(mlp_params()), jax.tree.leaves(state.params)):
        k = split_dim(leaf.shape, 4)  # split over a group's 4 devices, not all 8
        blocks = {s.device.id: s for s in kept.addressable_shards}
        assert blocks[0].data.shape == tuple(s // 4 if d == k else s for d, s in enumerate(leaf.shape))
        for d in range(4):  # device d of group 0 and device d of group 1 hold the same block
            assert blocks[d].index == blocks[d + 4].index
    report = jdp.memory_report(step, state)
    assert "over 4 devices in each of 2 replica groups" in report.layout
    assert report.params == sum(x.nbytes // (4 if split_dim(x.shape, 4) >= 0 else 1)
                                for x in jax.tree.leaves(mlp_params()))


def test_gradient_blocks_cross_the_groups_in_one_all_reduce():
    step, state, _ = run(8, "sgd", layout="fsdp", replicas=2)
    hlo = step.lower(state, DATA[0]).compile().as_text()
    groups = {kind: set(re.findall(rf"= \S+ {kind}\(.*?replica_groups=(\{{[\d,{{}}]*\}})", hlo))
              for kind in ("all-gather", "reduce-scatter", "all-reduce")}
    within, across = "{{0,1,2,3},{4,5,6,7}}", "{{0,4},{1,5},{2,6},{3,7}}"
    assert groups["all-gather"] == groups["reduce-scatter"] == {within}
    # the blocks across the groups; the loss, metrics and whole leaves over all 8 devices (which XLA may
    # run as an all-reduce within each group and one across them); the norm's squares within a group
    assert across in groups["all-reduce"] and groups["all-reduce"] <= {across, within, "{{0,1,2,3,4,5,6,7}}"}
    report = jdp.comm_report(step, state, DATA[0])
    split = sum(x.nbytes for x in jax.tree.leaves(mlp_params()) if split_dim(x.shape, 4) >= 0)
    (blocks,) = [c for c in report.allreduces if c.group == 2]
    assert blocks.bytes == split // 4  # one device's blocks cross between the groups, not the gradient
    (scatter,) = report.of_kind("reduce-scatter")
    assert scatter.group == 4 and scatter.ring_bytes(8) == pytest.approx(3 / 4 * split)
    assert "(groups of 2)" in str(report)


def test_a_diverged_group_copy_is_found():
    _, state, _ = run(8, "sgd", layout="fsdp", replicas=2)
    leaf = state.params["l1"]["w"]
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    shards[5] = shards[5] + 1e-3  # group 1's copy of device 1's block drifts
    forked = jax.make_array_from_single_device_arrays(
        leaf.shape, leaf.sharding, [jax.device_put(x, s.device) for x, s in zip(shards, leaf.addressable_shards)])
    bad = state.replace(params={**state.params, "l1": {**state.params["l1"], "w": forked}})
    with pytest.raises(jdp.ReplicaMismatchError, match=r"\['l1'\]\['w'\]: device 5 differs from device 1"):
        jdp.check_replicas(bad)


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match=r"^replicas=2 \(hybrid sharding\) splits the sharded state within groups of "
                                         r"devices; it needs shard_params=True or shard_optimizer_state=True"):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), replicas=2)
    with pytest.raises(ValueError, match=r"^replicas=3 does not divide the 8 devices into equal groups; use a "
                                         r"divisor of 8\.$"):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), shard_params=True, replicas=3)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=rf"^replicas={bad!r} must be an integer of at least 1\.$"):
            jdp.make_train_step(mlp_loss, optax.sgd(0.1), shard_params=True, replicas=bad)
    with pytest.raises(ValueError, match=r"^axis_name='shard' is one of hybrid sharding's two mesh axes"):
        jdp.make_train_step(mlp_loss, optax.sgd(0.1), shard_params=True, replicas=2, axis_name="shard")

    def synchronised(params, batch):  # a collective of the loss's own over the step's one-axis name
        return lax.pmean(mlp_loss(params, batch), "data")

    step = jdp.make_train_step(synchronised, optax.sgd(0.1), shard_params=True, replicas=2)
    with pytest.raises(ValueError, match=r"reduces over the mesh axis 'data' .* with replicas=2 \(hybrid sharding\) "
                                         r"the step's devices lie on two axes, \('replica', 'shard'\)"):
        step(step.init(mlp_params()), DATA[0])


def test_config_key_and_a_resume_across_it(tmp_path):
    from jdp.config import load_config
    from jdp.run.sections import ConfigError
    from jdp.train import train

    def config(*extra):
        return load_config(None, ["train.steps=4", "train.log_every=1", "train.checkpoint_every=2",
                                  "data.batch_size=64", "model.hidden=[16]", "optim.clip_norm=1.0",
                                  "parallel.shard_params=true", *extra])

    def go(cfg, workdir, n, stop_after=None):
        return train(cfg, str(workdir), devices=jax.devices()[:n], log=lambda *_: None, progress=False,
                     stop_after=stop_after)

    whole = go(config(), tmp_path / "whole", 2)
    go(config("parallel.replicas=2"), tmp_path / "a", 8, stop_after=2)  # 2 groups of 4 ...
    last = go(config("parallel.replicas=hosts"), tmp_path / "a", 4)  # ... resumed with one group (one process)
    assert last.resumed_from == 2 and last.steps == 4
    assert max_abs_diff(last.params, whole.params) <= 2e-6
    with pytest.raises(ConfigError, match=r"^parallel\.replicas must be a positive integer or 'hosts' \(one group per "
                                          r"process\), got 'host'\.$"):
        load_config(None, ["parallel.replicas=host"])
    with pytest.raises(ConfigError, match=r"^parallel\.replicas='hosts' \(hybrid sharding: one group per process\) "
                                          r"splits the sharded state"):
        load_config(None, ["parallel.replicas=hosts"])
    with pytest.raises(ConfigError, match=r"^parallel\.replicas=3 does not divide the 8 devices"):
        load_config(None, ["parallel.replicas=3", "parallel.shard_params=true", "parallel.devices=8"])


def test_per_layer_gathering_in_replica_groups_equals_one_device():
    # the GPT gathers each layer within its group inside the scan; the transposes reduce-scatter
    # within the group, and the blocks cross the groups once
    from tests.test_fsdp_layers import run as gpt_run

    _, one, norm = gpt_run(1)
    step, hybrid, hybrid_norm = gpt_run(8, shard_params=True, gather_in_model=True, replicas=2)
    assert max_abs_diff(jdp.get_params(hybrid), jdp.get_params(one)) <= 1e-6
    assert hybrid_norm == pytest.approx(norm, rel=1e-5)
    assert jdp.memory_report(step, hybrid).gathered == "per layer, by the model (gather_in_model)"


def test_synchronised_batchnorm_reduces_over_both_axes():
    # jdp.nnx names every BatchNorm's axes itself: under hybrid sharding, both of the mesh's axes, so the
    # statistics are the global batch's; the trainer's CNN (model.sync_batchnorm) takes the same axes
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.inp, self.bn, self.out = nnx.Linear(12, 16, rngs=rngs), nnx.BatchNorm(16, rngs=rngs), \
                nnx.Linear(16, 5, rngs=rngs)

        def __call__(self, x):
            return self.out(jnp.tanh(self.bn(self.inp(x))))

    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()

    def trained(n, **options):
        step = jdp.nnx.make_train_step(Net(nnx.Rngs(0)), loss_fn, optax.sgd(0.3), devices=jax.devices()[:n], **options)
        state = step.init()
        for batch in DATA[:3]:
            state, _ = step(state, batch)
        return jdp.get_params(state), jax.device_get(step.canonical(state).model_state)

    (one, one_stats), (hybrid, stats) = trained(1), trained(8, shard_params=True, replicas=2)
    assert max_abs_diff(hybrid, one) <= TOL and max_abs_diff(stats, one_stats) <= TOL


def test_trainer_cnn_with_synchronised_batchnorm_in_replica_groups(tmp_path):
    from jdp.config import load_config
    from jdp.train import train

    def go(n, *extra):
        config = load_config(None, ["model.name=cnn", "model.channels=[4,8]", "model.sync_batchnorm=true",
                                    "train.steps=2", "data.batch_size=32", *extra])
        return train(config, str(tmp_path / str(n)), devices=jax.devices()[:n], log=lambda *_: None, progress=False)

    whole, hybrid = go(2), go(8, "parallel.shard_params=true", "parallel.replicas=2")
    assert max_abs_diff(hybrid.params, whole.params) <= 2e-6


def test_per_layer_gathering_in_replica_groups_sums_the_blocks_across_the_groups():
    # The cheap form of the GPT test above: a loss that gathers its own params (as a scanned layer does)
    # gets Split blocks; their gradients, reduce-scattered within each group by the gathers' transposes,
    # must still be summed across the groups. SGD shows a group's half of the gradient.
    def gathering_loss(params, batch):
        return mlp_loss(jdp.fsdp.gather(params), batch)

    _, one, _ = run(1, "sgd")
    step = jdp.make_train_step(gathering_loss, OPTIMIZERS["sgd"], devices=jax.devices()[:8], shard_params=True,
                               gather_in_model=True, replicas=2)
    state = step.init(mlp_params())
    for batch in DATA[:3]:
        state, _ = step(state, batch)
    assert max_abs_diff(jdp.get_params(state), jdp.get_params(one)) <= TOL
