"""What to train, built from a config: model, data, loss and evaluation metrics as plain functions."""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jdp.bridges.task import Task
from jdp.core.mesh import DATA_AXIS, device_axes
from jdp.core.precision import DTYPES
from jdp.core.step import make_train_step
from jdp.core.weighting import Weighted
import jdp.data as D
from jdp.data import MASK_KEY, ArrayDataset
from jdp.data.tokenizer import read_metadata
from jdp.models import CNN, GPT, MLP, functional
from jdp.run.config_sections import HOSTS
from jdp.text import quoted, shorten


def _masked_mean(values, batch):
    """mean over the b examples given, padded ones counting 0: sum(mask · v) / b (jdp's mask contract)."""
    mask = batch.get(MASK_KEY)
    return jnp.mean(values) if mask is None else jnp.sum(values * mask) / values.shape[0]


def _classifier(fm, description, train, test) -> Task:
    def loss_fn(params, model_state, batch, rng):
        logits, new_state = fm.apply_with_state(params, model_state, batch["x"], train=True)
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        accuracy = (logits.argmax(-1) == batch["y"]).astype(jnp.float32)
        return _masked_mean(per_example, batch), ({"accuracy": _masked_mean(accuracy, batch)}, new_state)

    def metric_fn(params, model_state, batch):
        logits, _ = fm.apply_with_state(params, model_state, batch["x"], train=False)
        return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]),
                "accuracy": logits.argmax(-1) == batch["y"]}

    return Task(fm.params, fm.rest, loss_fn, metric_fn, train, test, description)


def _token_weights(batch, shape):
    """(b, T) weight of every predicted token: 1, or 0 in a padded window (the batch's row mask)."""
    mask = batch.get(MASK_KEY)
    return jnp.ones(shape, jnp.float32) if mask is None else jnp.broadcast_to(mask[:, None], shape)


def _token_losses(fm, params, model_state, batch, loss_chunk: int, **kwargs):
    """(nll, predicted, new_state) of a language model's batch: nll (b, T) float32 per token, predicted
    (b, T) the argmax ids; from the whole logits (loss_chunk 0) or by the GPT's fused, chunked
    cross-entropy with loss_chunk positions per block (`GPT.token_losses`), equal to rounding."""
    if loss_chunk:
        (nll, predicted), new_state = fm.apply_method_with_state(
            params, model_state, "token_losses", batch["x"], batch["y"], chunk=loss_chunk, **kwargs)
        return nll, predicted, new_state
    logits, new_state = fm.apply_with_state(params, model_state, batch["x"], **kwargs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), logits.argmax(-1), new_state


def language_model(fm, description, train, test, bytes_per_token: float | None = None, loss_chunk: int = 0) -> Task:
    """Per-token means: the loss and accuracy as sums over real tokens with their count (jdp.Weighted).
    `bytes_per_token`: UTF-8 bytes of text per held-out token, for bits per byte (None: unknown).
    `loss_chunk`: 0, the loss from the whole logits; else the GPT's fused cross-entropy with that
    many positions per block (model.loss_chunk), in training and evaluation."""
    def loss_fn(params, model_state, batch, rng):
        nll, predicted, new_state = _token_losses(fm, params, model_state, batch, loss_chunk, train=True, rngs=rng)
        w = _token_weights(batch, batch["y"].shape)
        correct = (predicted == batch["y"]).astype(jnp.float32)
        return Weighted(jnp.sum(w * nll), jnp.sum(w)), ({"accuracy": Weighted(jnp.sum(w * correct), jnp.sum(w))},
                                                         new_state)

    def metric_fn(params, model_state, batch):
        nll, predicted, _ = _token_losses(fm, params, model_state, batch, loss_chunk, train=False)
        w = jnp.ones(batch["y"].shape, jnp.float32)  # the evaluation leaves padded windows out itself
        return {"loss": Weighted(w * nll, w), "accuracy": Weighted(w * (predicted == batch["y"]), w)}

    return Task(fm.params, fm.rest, loss_fn, metric_fn, train, test, description, per_token=True,
                bytes_per_token=bytes_per_token)


def _regression(w0, description, train, test) -> Task:
    def predict(params, x):
        return x @ params["w"] if x.ndim == 2 else x * params["w"]

    def loss_fn(params, model_state, batch, rng):
        return _masked_mean((predict(params, batch["x"]) - batch["t"]) ** 2, batch), ({}, model_state)

    def metric_fn(params, model_state, batch):
        return {"loss": (predict(params, batch["x"]) - batch["t"]) ** 2}

    return Task({"w": np.asarray(w0, np.float32)}, (), loss_fn, metric_fn, train, test, description)


# The models (by config name) with non-parameter state: the cnn's BatchNorm statistics.
CNN_INPUT_SHAPES = ((8, 8, 1), (64,))  # per example: an 8×8 single-channel image, or its 64 pixels


def class_limit(n: int) -> int:
    """Labels a classifier takes from `n` examples: 0 to class_limit(n) - 1, i.e. max(n, 1024) classes.

    The output layer gets one unit per label up to the largest, so one stray label of 2^40 would ask
    for terabytes; more classes than examples (above a small floor) can only come from such a label.
    """
    return max(n, 1024)


def _checked_arrays(path, model: str, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A user's `x` (as float32) and `y` after checking that `model` can train on them; ValueError otherwise."""
    where = f"data.path {quoted(path)}:"
    for name, a in (("x", x), ("y", y)):
        if a.dtype.kind not in "biuf":
            raise ValueError(f"{where} array {name!r} has dtype {a.dtype}; it must hold numbers (bool, int or float).")
    if model == "linear":
        if x.ndim > 2:
            raise ValueError(f"{where} array 'x' has shape {x.shape}; the linear model takes shape (n,) or "
                             f"(n, features).")
    elif model == "cnn" and x.shape[1:] not in CNN_INPUT_SHAPES:
        raise ValueError(f"{where} array 'x' has shape {x.shape}; the cnn takes 8×8 images of shape (n, 8, 8, 1) "
                         f"or (n, 64).")
    elif x.ndim < 2:
        raise ValueError(f"{where} array 'x' has shape {x.shape}; the {model} takes one row of features per "
                         f"example, shape (n, features...); use x[:, None] for a single feature.")
    if x.ndim > 1 and 0 in x.shape[1:]:
        raise ValueError(f"{where} array 'x' has shape {x.shape}: zero features per example, so there is nothing "
                         f"to train on; save the inputs as 'x' with at least one feature.")
    if y.ndim != 1:
        raise ValueError(f"{where} array 'y' has shape {y.shape}; it must hold one "
                         f"{'target' if model == 'linear' else 'class label'} per example, shape (n,).")
    if model != "linear":
        _check_labels(where, model, y)
    for name, a in (("x", x), ("y", y)):
        _check_float32(where, name, a)
    return x.astype(np.float32), y


def _check_labels(where: str, model: str, y: np.ndarray) -> None:
    """Refuse class labels that are not integers in [0, class_limit(n)), before any model is sized by them."""
    if y.dtype.kind not in "iu" or y.min() < 0:
        got = f"dtype {y.dtype}" if y.dtype.kind not in "iu" else f"the negative label {y.min()}"
        raise ValueError(f"{where} array 'y' has {got}; the {model} needs integer class labels 0, 1, 2, ...")
    limit = class_limit(len(y))
    if y.max() >= limit:
        raise ValueError(f"{where} array 'y' has the label {y.max()}; with {len(y)} examples the {model} takes "
                         f"labels 0 to {limit - 1} (max(n, 1024) classes: each label up to the largest is an output).")


def _check_float32(where: str, name: str, a: np.ndarray) -> None:
    """Refuse NaN/±inf, and values that the cast to float32 (jdp trains in float32) would turn into ±inf."""
    if a.dtype.kind != "f":
        return  # ints of up to 64 bits stay finite in float32 (whose range is ±3.4e38)
    bad = int(a.size - np.count_nonzero(np.isfinite(a)))
    if bad:
        raise ValueError(f"{where} array {name!r} has {bad} non-finite value{'s' * (bad > 1)} (NaN or ±inf); "
                         f"remove or replace them: every loss and gradient they touch would be NaN.")
    top = np.finfo(np.float32).max
    if a.dtype.itemsize > 4 and a.size and max(a.max(), -a.min()) > top:
        worst = a.max() if a.max() >= -a.min() else a.min()
        raise ValueError(f"{where} array {name!r} has the value {worst:.6g}, beyond float32's range (±{top:.6g}), "
                         f"which jdp casts it to; rescale it.")


def compute_dtype(config):
    """The `dtype=` jdp's models are built with for train.precision: None for float32 (the models'
    own default, so float32 runs stay bit for bit what they were), jnp.bfloat16 for bfloat16."""
    return None if config.train.precision == "float32" else DTYPES[config.train.precision]


def token_files(config) -> tuple:
    """(training, held-out or None) windows of a `data.name: tokens` config's files, as `build_task` reads them."""
    m, d = config.model, config.data
    train = D.load_tokens(d.path, context_length=m.context, dtype=d.dtype, vocab_size=d.vocab_size)
    test = d.val_path and D.load_tokens(d.val_path, context_length=m.context, dtype=d.dtype, vocab_size=d.vocab_size)
    return train, test or None


def gpt_for(config, vocab_size: int, rngs: nnx.Rngs | None = None) -> GPT:
    """The GPT `jdp train` builds for a `data.name: chars | tokens` config over `vocab_size` ids (model.*,
    train.precision's compute dtype), initialised from `rngs` (default: nnx.Rngs(train.seed)); with
    model.init_from, the Hugging Face GPT-2 checkpoint there instead (its sizes and vocabulary)."""
    from jdp.run.device_defaults import AUTO, choose_attention

    m = config.model
    # "auto" not yet chosen (`jdp.run.device_defaults`: a training run chooses before it builds): the
    # attention for this backend, and remat on, the choice that needs the least memory
    attention = choose_attention(m.attention, jax.default_backend(), config.train.precision)[0]
    if m.init_from is not None:
        from jdp.models.hub import gpt_from_hf

        return gpt_from_hf(m.init_from, dtype=compute_dtype(config), attention=attention, dropout=m.dropout,
                           remat=m.remat == AUTO or m.remat, scan_layers=m.scan_layers)
    return GPT(vocab_size, m.context, d_model=m.d_model, n_heads=m.n_heads, n_layers=m.n_layers, dropout=m.dropout,
               dtype=compute_dtype(config), attention=attention, remat=m.remat == AUTO or m.remat,
               scan_layers=m.scan_layers, rngs=rngs or nnx.Rngs(config.train.seed))


def gpt_task(config, vocab_size: int, rngs, description: str, train, test, bytes_per_token=None) -> Task:
    """The language-model task of jdp's GPT over `vocab_size` ids, with its model FLOPs counted by
    nanoGPT's formula (6N + 12·L·H·Q·T per token, N without the position embedding) over windows of
    model.context tokens."""
    from jdp.inspect.flops import GPT_SOURCE, gpt_flops_per_token, gpt_params_without_position

    m = config.model
    fm = functional(gpt_for(config, vocab_size, rngs))
    per_token = gpt_flops_per_token(gpt_params_without_position(fm.params), m.n_layers, m.d_model, m.context)
    return dataclasses.replace(language_model(fm, description, train, test, bytes_per_token, m.loss_chunk),
                               flops_per_example=per_token * m.context, flops_source=GPT_SOURCE)


def char_bytes_per_token(corpus) -> float:
    """UTF-8 bytes per character of the corpus's held-out text (a character is one token of the char GPT)."""
    text = corpus.text[len(corpus.text) - len(corpus.val):]
    return len(text.encode("utf-8")) / len(text)


def token_bytes_per_token(val_path: str, vocab_size: int) -> float | None:
    """UTF-8 bytes of text per token of the held-out token file `val_path`: its directory's metadata's
    val split (bytes / tokens, `jdp.data.tokenizer.read_metadata`); without metadata, 1 where
    vocab_size is 256 (the byte tokenizer's files: one token per byte); else None (unknown)."""
    meta = read_metadata(os.path.dirname(os.path.abspath(val_path)))
    if meta is None:
        return 1.0 if vocab_size == 256 else None
    split = (meta.get("splits") or {}).get("val") or {}
    tokens, size = split.get("tokens"), split.get("bytes")
    return size / tokens if tokens and size else None


def build_task(config) -> Task:
    """The task a `jdp.config.Config` describes (model × dataset), initialised from train.seed.

    The models compute in train.precision's dtype (`compute_dtype`; params stay float32, logits
    float32), in training and in evaluation alike; the gpt takes model.attention, model.remat and model.scan_layers.
    The linear regression has no model: the step's cast of params and inputs sets its dtype.
    """
    m, d = config.model, config.data
    rngs, dtype = nnx.Rngs(config.train.seed), compute_dtype(config)
    if d.name == "seed_linear":
        ds = D.load_seed_regression(d.seed_example)
        return _regression(D.SEED_REGRESSIONS[d.seed_example].w0, f"linear regression, seed example "
                           f"{d.seed_example}", ds, None)
    if d.name == "chars":
        corpus = D.load_char_corpus()
        train = D.char_windows(corpus.train, m.context, stride=m.context // 2)
        test = D.char_windows(corpus.val, m.context, stride=m.context)
        return gpt_task(config, corpus.vocab_size, rngs, f"char GPT ({corpus.vocab_size} symbols)", train, test,
                        char_bytes_per_token(corpus))
    if d.name == "tokens":
        train, test = token_files(config)
        start = f" from {quoted(m.init_from)}" if m.init_from else ""  # a Hugging Face GPT-2 checkpoint
        return gpt_task(config, d.vocab_size, rngs, f"GPT{start} on tokens {quoted(d.path)} ({d.vocab_size} ids)",
                        train, test, d.val_path and token_bytes_per_token(d.val_path, d.vocab_size))
    if d.name == "digits":
        x, y, xt, yt = D.load_digits(d.test_fraction, images=m.name == "cnn")
        train, test = ArrayDataset({"x": x, "y": y}), ArrayDataset({"x": xt, "y": yt})
    else:  # "arrays": a user's .npz with "x" and "y"
        arrays = D.load_arrays(d.path).arrays
        if set(arrays) != {"x", "y"}:
            raise ValueError(f"data.path {quoted(d.path)} must hold exactly the arrays 'x' and 'y', got "
                             f"{shorten(str(sorted(arrays)))}.")
        x, y = _checked_arrays(d.path, m.name, arrays["x"], arrays["y"])
        n_test = D.held_out_count(len(x), d.test_fraction)
        if n_test >= len(x):
            raise ValueError(f"data.test_fraction={d.test_fraction} holds out round({len(x)} × {d.test_fraction}) = "
                             f"{n_test} of the {len(x)} examples of data.path {quoted(d.path)} (arrays 'x' and 'y'), "
                             f"leaving no training example; lower data.test_fraction or add examples.")
        order = np.random.default_rng(config.train.seed).permutation(len(x))
        train = ArrayDataset({"x": x[order[n_test:]], "y": y[order[n_test:]]})
        test = ArrayDataset({"x": x[order[:n_test]], "y": y[order[:n_test]]}) if n_test else None
        if m.name == "linear":
            return _regression(np.zeros(x.shape[1:], np.float32), f"linear regression on {d.path}",
                               ArrayDataset({"x": train.arrays["x"], "t": train.arrays["y"].astype(np.float32)}),
                               test and ArrayDataset({"x": test.arrays["x"], "t": test.arrays["y"].astype(np.float32)}))
    n_classes = int(max(train.arrays["y"].max(), test.arrays["y"].max() if test else 0)) + 1
    global_view = config.parallel.backend == "jit"
    if m.name == "cnn":
        # synchronised statistics over every device of the step: both axes of hybrid sharding's mesh
        # parallel.backend jit: the loss sees the global batch, so BatchNorm needs no axis for global statistics
        model = CNN(n_classes, tuple(m.channels), sync_batchnorm=m.sync_batchnorm and not global_view, dtype=dtype,
                    rngs=rngs, axis_name=device_axes(DATA_AXIS, step_replicas(config)))
    else:
        in_dim = int(np.prod(train.arrays["x"].shape[1:]))
        model = MLP([in_dim, *m.hidden, n_classes], dtype=dtype, rngs=rngs)
    task = _classifier(functional(model), f"{m.name} on {d.name} ({n_classes} classes)", train, test)
    # The CNN without sync_batchnorm keeps per-device statistics, which the step must then accept.
    return dataclasses.replace(task, sync_batchnorm=m.name != "cnn" or m.sync_batchnorm or global_view)


def step_replicas(config) -> int:
    """The replica groups of `config`'s step: parallel.replicas ("hosts": one per process) under a
    sharded layout (parallel.shard_optimizer_state or shard_params), else 1."""
    p = config.parallel
    if not (p.shard_optimizer_state or p.shard_params):
        return 1
    return jax.process_count() if p.replicas == HOSTS else p.replicas


def train_step_for(config, task: Task, devices):
    """The step `jdp train` runs for `config` (a `jdp.config.Config`) on `task`."""
    p, t = config.parallel, config.train
    return make_train_step(task.loss_fn, config.optimizer_spec(), backend=p.backend, reduction=p.reduction,
                           lr_correction=p.lr_correction, devices=devices, has_aux=True, needs_rng=True,
                           has_state=True, accum_steps=p.accum_steps, accum_sync=p.accum_sync,
                           skip_nonfinite=t.max_nonfinite > 0, precision=t.precision, reduce_dtype=p.reduce_dtype,
                           sync_batchnorm=task.sync_batchnorm, shard_optimizer_state=p.shard_optimizer_state,
                           shard_params=p.shard_params, replicas=step_replicas(config),
                           mask_key=MASK_KEY,  # a task's mean loss is sum(mask · l) / b on padded batches
                           # a scanned GPT gathers each layer in its scan body: the peak holds one layer
                           # (under backend jit the partitioner gathers)
                           gather_in_model=p.shard_params and config.model.scan_layers and p.backend != "jit")
