"""Flax's NNX language-model example (google/flax examples/gemma at 18f8f311, `tests/flax_gemma/`, its
files byte for byte), ported to jdp on packed rows whose real-token counts differ between rows,
devices and micro-batches.

The example's step is `jax.jit` over GLOBAL arrays on an ("fsdp", "tensor") mesh with Explicit axes;
its params carry sharding annotations (`out_sharding`), and its loss divides the summed token loss by
the real tokens of the whole batch: exact under jit, a mean of per-device means where the same
function runs per device. The reference is the example's own `jax_train_step` (its default path,
`use_nnx_transforms="no"`), jitted as its `train_and_evaluate` jits it, on ONE device under
`jax.set_mesh` of a 1×1 ("fsdp", "tensor") mesh, on the whole global batch.

The port is the train step's `loss_fn`, its text as written (moved, with the train step's lines that
make the masks, into one function of the batch). Changed lines against the example, data loading
aside, each marked `# jdp`: 5 —
  1. the loss takes the batch as an argument (`loss_fn(model, batch, rngs)`, jdp.nnx's form) instead
     of closing over the train step's arguments,
  2. it returns `mean_loss` alone (its aux, per-row losses and logits, are arrays; jdp's aux are
     scalars), or for accumulation `jdp.Weighted(mean_loss * weights.sum(), weights.sum())` (the
     same value as a sum over the batch's real tokens and their count),
  3. `jdp.nnx.make_train_step(model, loss_fn, optimizer, ...)` replaces `jit_fn(jax_train_step, ...)`;
     through jit its options name the example's own mesh (`mesh=mesh`): the step runs on it, the
     batch split over its "fsdp", the params as their annotations say,
  4. `state = step.init()` makes the step's state from the model and the optimizer,
  5. `state, metrics = step(state, batch)` replaces `jit_train_step(model, optimizer, rngs, ...)` and
     `nnx.update(...)`.
Counted as the lines marked so (`grep -c 'jdp ([1-5])$' tests/test_flax_gemma.py`: 5); the dict of
the run's options (devices, mesh, the mode's options) is the test's, as the example's config is.
Reading the params for the comparison (`jdp.get_params(state)`) is the test's, as
`nnx.state(model, nnx.Param)` is on the reference's side.

Tests: the loss as written is refused by the first-call audit under shard_map (it divides by each
device's own count); its weighted form under shard_map equals the example's step on one device; and
through `backend="jit"` on the example's own mesh, with the annotations kept, the loss as written
equals it, with accumulation and FSDP.
"""
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from flax_gemma import load

import jdp
from jdp.core.audit import AuditError

VOCAB, LENGTH, N, B, STEPS = 64, 16, 4, 2, 3  # tokens, row length, devices, rows per device and call, steps
gemma = load()
example, transformer_lib = gemma.train, gemma.transformer
ShardingConfig = gemma.transformer_cfg.ShardingConfig


def config(shd_config):
    """A tiny model of the example's configs' kind (configs/tiny.py, smaller), float32 activations."""
    return transformer_lib.TransformerConfig.from_dict(
        num_layers=2, embed_dim=32, hidden_dim=64, num_heads=2, head_dim=16, num_kv_heads=1, use_post_attn_norm=False,
        use_post_ffw_norm=False, attention_types=(1, 1), final_logit_softcap=None, num_embed=VOCAB, dtype=jnp.float32,
        shd_config=shd_config)


def packed_rows(rows, seed):
    """Data loading: rows packed with segments of 2-7 tokens up to a random fill, then padding (0)."""
    rng = np.random.default_rng(seed)
    inputs, targets, segments, positions = (np.zeros((rows, LENGTH), np.int32) for _ in range(4))
    for r in range(rows):
        filled, segment = 0, 1
        fill = rng.integers(3, LENGTH + 1)
        while filled < fill:
            n = min(int(rng.integers(2, 8)), fill - filled)
            inputs[r, filled:filled + n] = rng.integers(1, VOCAB, n)
            targets[r, filled:filled + n] = rng.integers(1, VOCAB, n)
            segments[r, filled:filled + n], positions[r, filled:filled + n] = segment, np.arange(n)
            filled, segment = filled + n, segment + 1
    return {"inputs": inputs, "targets": targets, "inputs_segmentation": segments, "inputs_position": positions}


def global_batches(m):
    return [packed_rows(m * N * B, seed=s) for s in range(STEPS)]


def model_and_optimizer(shd_config, mesh=None):
    """The example's model and optimizer, as its train_and_evaluate makes them (under its mesh)."""
    lr_fn = example.create_learning_rate_schedule(learning_rate=0.01, warmup_steps=2)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        model = transformer_lib.Transformer(config(shd_config), rngs=nnx.Rngs(params=0, dropout=0),
                                            sow_config=gemma.sow_lib.SowConfig())
        optimizer = nnx.Optimizer(model, tx=optax.adamw(lr_fn, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1),
                                  wrt=nnx.Param)
    return model, optimizer


def params_of(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


@functools.lru_cache(maxsize=None)
def one_device(m):
    """The example's own jax_train_step, jitted as train_and_evaluate jits it, on one device."""
    mesh = jax.make_mesh((1, 1), ("fsdp", "tensor"), devices=jax.devices()[:1])
    model, optimizer = model_and_optimizer(ShardingConfig.fsdp_tp_sharding(fsdp_axis_name="fsdp",
                                                                           tensor_parallel_axis_name="tensor"), mesh)
    rngs = nnx.Rngs(params=0, dropout=0)
    train_metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())
    jit_train_step = jax.jit(functools.partial(example.jax_train_step, with_capture=True),
                             static_argnames=("label_smoothing", "pad_id"), donate_argnames=("model", "optimizer"))
    with jax.set_mesh(mesh):
        for batch in global_batches(m):
            updates, _ = jit_train_step(model, optimizer, rngs, batch, train_metrics, 0.0, 0)
            nnx.update((model, optimizer, rngs, train_metrics), updates)
    return params_of(model)


def port_loss_fn(weighted=False, label_smoothing=0.0, pad_id=0, with_capture=True):
    def loss_fn(model, batch, rngs):  # jdp (1)
        train_keys = ["inputs", "inputs_position", "inputs_segmentation", "targets"]
        inputs, inputs_positions, inputs_segmentation, targets = (
            batch.get(k, None) for k in train_keys
        )

        input_mask = inputs > pad_id
        weights = input_mask.astype(jnp.float32)
        attention_mask = transformer_lib.make_causal_attn_mask(
            input_mask
        )  # (B, L, L)
        if inputs_segmentation is not None:
            # inputs_segmentation: (B, L)
            mask = (
                inputs_segmentation[:, :, None] == inputs_segmentation[:, None, :]
            )  # (B, L, L)
            attention_mask = jnp.logical_and(mask, attention_mask)

        if with_capture:
            forward = nnx.capture(model, nnx.Intermediate)
        else:
            forward = model
        output = forward(
            inputs,
            positions=inputs_positions,
            attention_mask=attention_mask,
            cache=None,
            rngs=rngs,
        )
        # output is (preds, cache) if with_capture=False
        # and is ((preds, cache), intermediates) if with_capture=True
        if with_capture:
            (logits, _), intermediates = output
        else:
            logits, _ = output
            intermediates = None

        loss_per_sample = example.compute_weighted_cross_entropy(
            logits, targets, weights, label_smoothing
        )
        mean_loss = loss_per_sample.mean()
        return jdp.Weighted(mean_loss * weights.sum(), weights.sum()) if weighted else mean_loss  # jdp (2)
    return loss_fn


def train_with_jdp(batches, shd_config, mesh=None, weighted=False, **options):
    """The port: `(params, metrics, state)` after training on `batches`; with a `mesh` (backend="jit"),
    the model is made under it and the step runs on it (`mesh=`), the batch split over its "fsdp"."""
    model, optimizer = model_and_optimizer(shd_config, mesh)
    options = {"devices": jax.devices()[:N], **({"mesh": mesh} if mesh is not None else {}), **options}  # the run's
    step = jdp.nnx.make_train_step(model, port_loss_fn(weighted), optimizer, needs_rng=True, **options)  # jdp (3)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        state = step.init()  # jdp (4)
        for batch in batches:
            for micro in step.micro_batches(batch):
                state, metrics = step(state, micro)  # jdp (5)
    return jdp.get_params(state), metrics, state


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_the_vendored_files_are_the_examples_and_token_counts_differ():
    assert gemma.train.__file__.endswith("tests/flax_gemma/train.py")
    counts = [int((b["inputs"] > 0).reshape(2, N, B * LENGTH).sum(-1)[k, d]) for b in global_batches(2)
              for k in range(2) for d in range(N)]
    assert len(set(counts)) > N  # per device and micro-batch
    rows = global_batches(1)[0]["inputs"] > 0
    assert len(set(rows.sum(1))) > 3  # per row


def test_the_loss_as_written_is_refused_by_the_audit_under_shard_map():
    model, optimizer = model_and_optimizer(ShardingConfig.no_sharding())
    step = jdp.nnx.make_train_step(model, port_loss_fn(), optimizer, needs_rng=True, devices=jax.devices()[:N])
    state = step.init()
    with pytest.raises(AuditError, match=r"divides by each device's own count.*jdp\.Weighted.*backend='jit'") as e:
        step(state, global_batches(1)[0])
    found = e.value.audit
    print(f"\naudit: as one call {found.gathered:.7g}, mean of the devices' own {found.own:.7g}")
    assert abs(found.gathered - found.own) > 1e-3 * abs(found.gathered)


def test_the_loss_as_written_is_refused_under_jit_with_accumulation():
    """Under jit the loss sees each call's whole micro-batch: divided by that micro-batch's own count of
    real tokens, accum_steps=2 would follow a mean of per-micro-batch means."""
    mesh = jax.make_mesh((N, 1), ("fsdp", "tensor"), devices=jax.devices()[:N])
    shd = ShardingConfig.fsdp_tp_sharding(fsdp_axis_name="fsdp", tensor_parallel_axis_name="tensor")
    with pytest.raises(AuditError, match=r"divides by each micro-batch's own count.*jdp\.Weighted") as e:
        train_with_jdp(global_batches(2), shd, mesh, backend="jit", accum_steps=2)
    assert "backend='jit'" not in str(e.value) and e.value.audit.where == "micro-batches"


def test_the_weighted_loss_under_shard_map_equals_the_examples_step_on_one_device():
    """The example's loss as a sum over real tokens with their count: exact per device too."""
    params, metrics, _ = train_with_jdp(global_batches(1), ShardingConfig.no_sharding(), weighted=True)
    d = max_diff(params, one_device(1))
    print(f"\nshard_map, weighted: params Δ {d:.1e} vs the example's step on one device")
    assert d <= 1e-6
    assert float(metrics["weight"]) == float((global_batches(1)[-1]["inputs"] > 0).sum())


JIT_MODES = {"jit": dict(), "jit-accum": dict(accum_steps=2, weighted=True), "jit-fsdp": dict(shard_params=True),
             "jit-fsdp-accum": dict(accum_steps=2, shard_params=True, weighted=True)}


@pytest.mark.parametrize("mode", JIT_MODES)
def test_the_port_through_jit_with_annotations_equals_the_examples_step_on_one_device(mode, capsys):
    """The example's step as it runs: global arrays under jax.set_mesh of a mesh with Explicit axes
    named as the example names them, params annotated; the step's axis is the example's "fsdp"."""
    options = dict(JIT_MODES[mode])
    m = options.get("accum_steps", 1)
    mesh = jax.make_mesh((N, 1), ("fsdp", "tensor"), devices=jax.devices()[:N])
    shd = ShardingConfig.fsdp_tp_sharding(fsdp_axis_name="fsdp", tensor_parallel_axis_name="tensor")
    params, _, state = train_with_jdp(global_batches(m), shd, mesh, backend="jit", **options)
    reference = one_device(m)
    d = max_diff(params, reference)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # the annotations honoured on the example's own mesh as written (they are its FSDP: split over "fsdp")
    embedding, norm = state.params["embedder"]["embedding"], state.params["final_norm"]["scale"]
    assert embedding.sharding.mesh == mesh and embedding.sharding.spec == P("tensor", "fsdp")
    assert norm.sharding.spec == P("tensor")  # whole: a split would change the type the model's code expects
    said = capsys.readouterr().err
    assert said.count("jdp: ") == (1 if options.get("shard_params") else 0)
    assert ("shard_params and shard_optimizer_state add no split of their own" in said) == (
        "shard_params" in options)
    print(f"\n{mode}: params Δ {d:.1e} vs the example's step on one device")
