"""Flax's ImageNet example (google/flax examples/imagenet), ported to jdp as it is written.

`flax_imagenet/models.py` is the example's ResNet, unchanged; `flax_imagenet/train.py` holds its
train.py functions unchanged (train_step, eval_step, create_train_state, the TrainState subclass with
`batch_stats` and `dynamic_scale`). The port is `port_loss_fn` and `train_with_jdp` below. Changed
lines against the example, data loading aside (each marked `# jdp`): 7 —
  1. the loss takes the statistics and the batch as arguments instead of closing over them,
  2. it applies the model to those statistics,
  3. it returns the metrics and `new_model_state['batch_stats']`, which the example's train_step
     pmeans itself,
  4. the port wraps the loss in a function of the TrainState (the example's train_step is one),
  5. `jdp.linen.make_train_step(state, loss_fn, axis_name='batch', has_aux=True)` replaces
     `jax.pmap(train_step, axis_name='batch')` and the replication of the state,
  6. `step(jstate, batch)` replaces the pmapped call (the batch is global: no reshape per device),
  7. `jdp.linen.to_train_state(state, jstate)` hands back params, batch_stats, opt_state and step.
The reference is the example's own train_step under `jax.pmap(axis_name='batch')` on one device.
The model's BatchNorms keep `axis_name='batch'`: jdp binds that axis.
"""
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax_imagenet import models
from flax_imagenet import train as example

import jdp

example.NUM_CLASSES = 10  # data loading: digits have 10 classes
CONFIG = types.SimpleNamespace(warmup_epochs=2, num_epochs=10, momentum=0.9, half_precision=False)  # the example's fields
STEPS, GLOBAL = 10, 64


def digits(split):
    """Digits padded to 16×16 with 3 channels, the example's image layout (data loading)."""
    x, y, xt, yt = jdp.data.load_digits(images=True)
    x, y = (x, y) if split == "train" else (xt, yt)
    x = np.pad(x, ((0, 0), (4, 4), (4, 4), (0, 0)))
    return {"image": np.repeat(x, 3, axis=-1).astype(np.float32), "label": y.astype(np.int32)}


TRAIN, TEST = digits("train"), digits("test")
BATCHES = [jax.tree.map(lambda a, i=i: a[i * GLOBAL:(i + 1) * GLOBAL], TRAIN) for i in range(STEPS)]


def initial_state(accum_steps=1):
    model = models.ResNet(stage_sizes=[1, 1], block_cls=models.ResNetBlock, num_classes=10, num_filters=8)
    lr_fn = example.create_learning_rate_fn(CONFIG, 0.1, steps_per_epoch=1)
    state = example.create_train_state(jax.random.key(0), CONFIG, model, 16, lr_fn)
    if accum_steps > 1:  # the reference of accumulation: optax.MultiSteps over the same micro-batches
        state = state.replace(tx=optax.MultiSteps(state.tx, accum_steps),
                              opt_state=optax.MultiSteps(state.tx, accum_steps).init(state.params))
    return state, lr_fn


@functools.lru_cache(maxsize=None)
def example_step(accum_steps):
    """The example's train_step under jax.pmap(axis_name='batch') on one device (compiled once per M)."""
    _, lr_fn = initial_state(accum_steps)
    return jax.pmap(functools.partial(example.train_step, learning_rate_fn=lr_fn), axis_name="batch",
                    devices=jax.devices()[:1])


@functools.lru_cache(maxsize=None)
def reference(accum_steps=1, permute=False):
    """The example on one device, one call per micro-batch: final params and batch_stats."""
    state, _ = initial_state(accum_steps)
    step = example_step(accum_steps)
    state = jax.tree.map(lambda x: np.asarray(x)[None], state)  # replicated on the one device
    rng = np.random.default_rng(1)
    for batch in BATCHES:
        for micro in np.split(np.arange(GLOBAL), accum_steps):
            rows = rng.permutation(micro) if permute else micro  # the noise floor: the same examples reordered
            state, _ = step(state, jax.tree.map(lambda a: a[rows][None], batch))
    return jax.device_get(jax.tree.map(lambda x: x[0], (state.params, state.batch_stats)))


def port_loss_fn(state):  # jdp (4): the example's train_step's loss, made from the TrainState
    def loss_fn(params, batch_stats, batch):  # jdp (1)
        """loss function used for training."""
        logits, new_model_state = state.apply_fn(
            {'params': params, 'batch_stats': batch_stats},  # jdp (2)
            batch['image'],
            mutable=['batch_stats'],
        )
        loss = example.cross_entropy_loss(logits, batch['label'])
        weight_penalty_params = jax.tree_util.tree_leaves(params)
        weight_decay = 0.0001
        weight_l2 = sum(
            jnp.sum(x**2) for x in weight_penalty_params if x.ndim > 1
        )
        weight_penalty = weight_decay * 0.5 * weight_l2
        loss = loss + weight_penalty
        return loss, (example.compute_metrics(logits, batch['label']), new_model_state['batch_stats'])  # jdp (3)
    return loss_fn


def train_with_jdp(loss_fn=None, **options):
    state, _ = initial_state()
    step, jstate = jdp.linen.make_train_step(state, loss_fn or port_loss_fn(state), axis_name='batch',  # jdp (5)
                                             has_aux=True, devices=jax.devices()[:4], **options)
    for batch in BATCHES:
        for micro in step.micro_batches(batch):
            jstate, metrics = step(jstate, micro)  # jdp (6)
    return step, jstate, jdp.linen.to_train_state(state, jstate), metrics  # jdp (7)


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


RUNS = [("shard_map", 1, "every"), ("pmap", 1, "every"), ("shard_map", 2, "every"), ("shard_map", 2, "last")]


@pytest.mark.parametrize("backend,m,sync", RUNS)
def test_port_equals_the_example_on_one_device(backend, m, sync):
    """4 devices == the example's own train_step on one device: params and batch_stats, to float32
    rounding (the noise floor: the same one-device run with each batch's rows reordered)."""
    _, jstate, trained, metrics = train_with_jdp(backend=backend, accum_steps=m, accum_sync=sync)
    want_params, want_stats = reference(m)
    floor_params, floor_stats = reference(m, permute=True)
    initial, _ = initial_state()
    d_params, d_stats = max_diff(trained.params, want_params), max_diff(trained.batch_stats, want_stats)
    print(f"\n{backend} M={m} {sync}: params Δ {d_params:.1e} (floor {max_diff(floor_params, want_params):.1e}), "
          f"batch_stats Δ {d_stats:.1e} (floor {max_diff(floor_stats, want_stats):.1e})")
    assert d_params <= 1e-5 and d_stats <= 1e-5
    assert max_diff(want_stats, initial.batch_stats) > 1e-2  # statistics trained: the comparison sees them
    assert int(trained.step) == STEPS and float(metrics["aux"]["accuracy"]) > 0.1


def test_to_train_state_and_evaluate_hand_back_the_trained_statistics():
    step, jstate, trained, _ = train_with_jdp()
    initial, _ = initial_state()
    assert max_diff(trained.batch_stats, initial.batch_stats) > 1e-2  # not the initial statistics

    def metric_fn(params, batch_stats, batch):  # per example, the model in eval mode
        logits = trained.apply_fn({'params': params, 'batch_stats': batch_stats}, batch['image'], train=False)
        return {"accuracy": (logits.argmax(-1) == batch['label']).astype(jnp.float32)}

    got = step.evaluate(jstate, metric_fn, TEST)["accuracy"]
    eval_step = jax.pmap(example.eval_step, axis_name="batch", devices=jax.devices()[:1])
    one = eval_step(jax.tree.map(lambda x: np.asarray(x)[None], trained), jax.tree.map(lambda a: a[None], TEST))
    assert abs(got - float(one["accuracy"][0])) <= 1e-6  # the example's own eval_step on the whole set


def test_natural_mistakes_are_refused_in_one_sentence():
    state, _ = initial_state()
    loss_fn = port_loss_fn(state)
    with pytest.raises(ValueError, match=r"reduces over the mesh axis 'batch' .* binds 'data': pass axis_name='batch'"):
        step, jstate = jdp.linen.make_train_step(state, loss_fn, has_aux=True, devices=jax.devices()[:4])
        step(jstate, BATCHES[0])

    def nested(params, batch_stats, batch):  # returns the whole mutable dict
        loss, (metrics, stats) = loss_fn(params, batch_stats, batch)
        return loss, (metrics, {"batch_stats": stats})
    with pytest.raises(ValueError, match=r"wrapped in \{'batch_stats': \.\.\.\}: return new_model_state\['batch_stats'\]"):
        train_with_jdp(nested)
    with pytest.raises(ValueError, match="dynamic_scale is set, but jdp has no fp16 loss scaling"):
        from flax.training import dynamic_scale
        jdp.linen.make_train_step(state.replace(dynamic_scale=dynamic_scale.DynamicScale()), loss_fn, has_aux=True)
