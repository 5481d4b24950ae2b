"""Flax's Linen language-model example (google/flax examples/lm1b at 654ae1a, its last pmap version),
ported to jdp as it is written, on packed rows whose real-token counts differ between rows, devices
and micro-batches.

`flax_lm1b/models.py` is the example's TransformerLM, unchanged; `flax_lm1b/train.py` holds its
train.py functions unchanged (train_step, eval_step, compute_weighted_cross_entropy, ...). The
example's train_step divides the token-loss sum by each device's own token count, then
`lax.pmean(grads, 'batch')`: the mean of per-device means, which is not the one-device step on the
global batch when the counts differ. The natural port of that loss into jdp is refused by the step's
first-call audit (`jdp.core.audit`); with audit=False, passed to show it, it reproduces the example's
own pmap run; the weighted port returns the sum and the count (`jdp.Weighted`) and equals one device
on the global batch in every mode. Changed lines against the example, data loading aside (each
marked `# jdp`): 8 —
  1. the loss takes the batch and the dropout key as arguments instead of closing over them,
  2. it returns `jdp.Weighted(loss, weight_sum)` instead of `loss / weight_sum` and the logits
     (natural port: `loss / weight_sum` alone, the per-device mean, for the comparison),
  3. `jdp.linen.make_train_step(state, loss_fn, axis_name='batch', needs_rng=True)` replaces
     `jax.pmap(train_step, axis_name='batch')`, the replication of the state and the dropout keys,
  4. `step(jstate, micro)` replaces the pmapped call (the batch is global: no `common_utils.shard`),
  5. `jdp.linen.to_train_state(state, step.canonical(jstate))` hands back params, opt_state and step,
  6. the evaluation's metric function returns each row's (sum, weight) of the example's own
     compute_weighted_cross_entropy / compute_weighted_accuracy as `jdp.Weighted`,
  7. `step.evaluate(jstate, metric_fn, data)` replaces the pmapped eval_step loop and its sums,
  8. the metric function applies the example's eval config (deterministic) model.
The reference is the example's own train_step under `jax.pmap(axis_name='batch')` on ONE device,
called on the whole global batch.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from flax_lm1b import models
from flax_lm1b import train as example

import jdp

# The example, as written, builds its attention with nn.SelfAttention, which flax 0.12 marks as
# deprecated: that warning is the example's, not jdp's, and the files stay unchanged.
pytestmark = pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated:DeprecationWarning")

VOCAB, LENGTH, N, B, STEPS = 64, 32, 4, 2, 6  # tokens, row length, devices, rows per device and call, steps


def config(dropout=0.0, deterministic=False):
    """The example's TransformerConfig, tiny (its train() builds it from ml_collections)."""
    return models.TransformerConfig(vocab_size=VOCAB, output_vocab_size=VOCAB, emb_dim=32, num_heads=2, num_layers=2,
                                    qkv_dim=32, mlp_dim=64, max_len=LENGTH, dropout_rate=dropout,
                                    attention_dropout_rate=dropout, deterministic=deterministic)


def packed_rows(rows, seed):
    """Data loading: rows packed with segments of 3-12 tokens up to a random fill, then padding (0)."""
    rng = np.random.default_rng(seed)
    inputs, segments, positions = (np.zeros((rows, LENGTH), np.int32) for _ in range(3))
    for r in range(rows):
        filled, segment = 0, 1
        fill = rng.integers(4, LENGTH + 1)
        while filled < fill:
            n = min(int(rng.integers(3, 13)), fill - filled)
            inputs[r, filled:filled + n] = rng.integers(1, VOCAB, n)
            segments[r, filled:filled + n], positions[r, filled:filled + n] = segment, np.arange(n)
            filled, segment = filled + n, segment + 1
    return {"inputs": inputs, "inputs_segmentation": segments, "inputs_position": positions}


def global_batches(m):
    return [packed_rows(m * N * B, seed=s) for s in range(STEPS)]


def initial_state(dropout=0.0):
    """The example's model, schedule and AdamW, as its train() creates them."""
    m = models.TransformerLM(config(dropout, deterministic=True))
    variables = jax.jit(m.init)(jax.random.key(0), jnp.ones((B, LENGTH), jnp.float32))
    lr_fn = example.create_learning_rate_schedule(learning_rate=0.01, warmup_steps=2)
    tx = optax.adamw(lr_fn, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)
    return train_state.TrainState.create(apply_fn=m.apply, params=variables["params"], tx=tx), lr_fn


def example_run(devices, batches):
    """The example's own train_step under jax.pmap(axis_name='batch') on `devices`."""
    state, lr_fn = initial_state()
    step = jax.pmap(functools.partial(example.train_step, config=config(), learning_rate_fn=lr_fn),
                    axis_name="batch", devices=jax.devices()[:devices])
    state = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (devices, *np.shape(x))), state)
    keys = jax.random.split(jax.random.key(0), devices)
    for batch in batches:
        state, _ = step(state, jax.tree.map(lambda a: a.reshape(devices, -1, LENGTH), batch), dropout_rng=keys)
    return jax.device_get(jax.tree.map(lambda x: x[0], state.params))


@functools.lru_cache(maxsize=None)
def one_device(m):
    return example_run(1, global_batches(m))


def port_loss_fn(cfg, weighted=True):
    def loss_fn(params, batch, dropout_rng):  # jdp (1)
        """loss function used for training."""
        train_keys = ["inputs", "inputs_position", "inputs_segmentation"]
        (inputs, inputs_positions, inputs_segmentation) = (
            batch.get(k, None) for k in train_keys
        )

        weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
        logits = models.TransformerLM(cfg).apply(
            {"params": params},
            inputs,
            inputs_positions=inputs_positions,
            inputs_segmentation=inputs_segmentation,
            rngs={"dropout": dropout_rng},
        )

        loss, weight_sum = example.compute_weighted_cross_entropy(
            logits, inputs, weights, 0.0
        )
        return jdp.Weighted(loss, weight_sum) if weighted else loss / weight_sum  # jdp (2)
    return loss_fn


def train_with_jdp(batches, weighted=True, dropout=0.0, seed=0, **options):
    state, _ = initial_state(dropout)
    step, jstate = jdp.linen.make_train_step(state, port_loss_fn(config(dropout), weighted), axis_name='batch',  # jdp (3)
                                             needs_rng=True, seed=seed, **{"devices": jax.devices()[:N], **options})
    for batch in batches:
        for micro in step.micro_batches(batch):
            jstate, metrics = step(jstate, micro)  # jdp (4)
    return step, jstate, jdp.linen.to_train_state(state, step.canonical(jstate)), metrics  # jdp (5)


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_token_counts_differ_between_devices_and_micro_batches():
    counts = [int((b["inputs"] > 0).reshape(2, N, B * LENGTH).sum(-1)[k, d]) for b in global_batches(2)
              for k in range(2) for d in range(N)]
    assert len(set(counts)) > N


def test_the_natural_port_reproduces_the_examples_own_pmap_run_and_both_differ_from_one_device():
    _, _, natural, _ = train_with_jdp(global_batches(1), weighted=False, audit=False)  # refused by default
    pmapped = example_run(N, global_batches(1))
    print(f"\nexample's 4-device pmap vs one device {max_diff(pmapped, one_device(1)):.1e}, "
          f"natural port vs the pmap run {max_diff(natural.params, pmapped):.1e}")
    assert max_diff(natural.params, pmapped) <= 1e-6
    assert max_diff(pmapped, one_device(1)) > 1e-4  # the mean of per-device means: visibly not one device


MODES = {"shard_map": dict(), "pmap": dict(backend="pmap"), "every": dict(accum_steps=2),
         "last": dict(accum_steps=2, accum_sync="last"), "zero1": dict(accum_steps=2, shard_optimizer_state=True),
         "fsdp": dict(accum_steps=2, accum_sync="last", shard_params=True),
         "skip_nonfinite": dict(accum_steps=2, skip_nonfinite=True)}


@pytest.mark.parametrize("mode", MODES)
def test_the_weighted_port_equals_one_device_on_the_global_batch(mode):
    m = MODES[mode].get("accum_steps", 1)
    step, _, trained, metrics = train_with_jdp(global_batches(m), **MODES[mode])
    d = max_diff(trained.params, one_device(m))
    print(f"\n{mode}: params Δ {d:.1e} vs one device")
    assert d <= 1e-6
    assert int(trained.step) == STEPS
    assert float(metrics["weight"]) == float((global_batches(m)[-1]["inputs"] > 0).sum())  # the step's tokens


def test_dropout_differs_per_device_and_reproduces_per_seed():
    """Four copies of the same rows: with one dropout key on every device, 4 devices would take the
    steps one device takes on one copy; with dropout off they do. (Three steps: the example's
    schedule warms up from a learning rate of 0.)"""
    rows = packed_rows(B, seed=7)
    copies = [jax.tree.map(lambda a: np.concatenate([a] * N), rows)] * 3
    runs = {}
    for dropout in (0.0, 0.3):
        _, _, four, _ = train_with_jdp(copies, dropout=dropout)
        _, _, one, _ = train_with_jdp([rows] * 3, dropout=dropout, devices=jax.devices()[:1])
        runs[dropout] = max_diff(four.params, one.params)
    assert runs[0.0] <= 1e-6 and runs[0.3] > 1e-4
    again = [train_with_jdp(copies, dropout=0.3, seed=s)[2].params for s in (0, 0, 1)]
    assert max_diff(again[0], again[1]) == 0.0 and max_diff(again[0], again[2]) > 1e-4


def test_evaluation_equals_the_examples_eval_step_on_one_device():
    step, jstate, trained, _ = train_with_jdp(global_batches(1))
    data = packed_rows(13, seed=99)  # 13 rows: evaluation batches of 8 on 4 devices, the last one padded
    eval_config = config(deterministic=True)

    def metric_fn(params, batch):  # jdp (6)
        inputs = batch["inputs"]
        weights = jnp.where(inputs > 0, 1.0, 0.0)
        logits = models.TransformerLM(eval_config).apply({"params": params}, inputs)  # jdp (8)
        loss = jax.vmap(example.compute_weighted_cross_entropy)(logits[:, None], inputs[:, None], weights[:, None])
        acc = jax.vmap(example.compute_weighted_accuracy)(logits[:, None], inputs[:, None], weights[:, None])
        return {"loss": jdp.Weighted(*loss), "accuracy": jdp.Weighted(*acc)}

    got = step.evaluate(jstate, metric_fn, {"inputs": data["inputs"]}, batch_size=8)  # jdp (7)
    p_eval = jax.pmap(functools.partial(example.eval_step, config=eval_config), axis_name="batch",
                      devices=jax.devices()[:1])
    sums = jax.device_get(p_eval(jax.tree.map(lambda x: np.asarray(x)[None], trained.params),
                                 {"inputs": data["inputs"][None]}))
    want = {k: float(sums[k][0] / sums["denominator"][0]) for k in ("loss", "accuracy")}
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    np.testing.assert_allclose(got["accuracy"], want["accuracy"], rtol=1e-6)


def test_the_natural_port_is_refused_by_the_first_call_audit():
    """The example's loss, divided by each device's own count, is refused before the first step."""
    from jdp.core.audit import AuditError

    state, _ = initial_state()
    step, jstate = jdp.linen.make_train_step(state, port_loss_fn(config(), weighted=False), axis_name='batch',
                                             needs_rng=True, devices=jax.devices()[:N])
    with pytest.raises(AuditError, match="jdp.Weighted.*backend='jit'"):
        step(jstate, global_batches(1)[0])
