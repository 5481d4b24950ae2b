"""Train jdp's small GPT on a character corpus with dropout, AdamW + warmup/cosine, and accumulation.

    python -m jdp.examples.char_gpt            # the full run: 600 optimizer steps
    python -m jdp.examples.char_gpt --steps 30 # a quick check

What it shows:

- `jdp.models.GPT` (d_model 64, 2 layers, context 64) on `jdp.data.load_char_corpus()`, the Python
  Language Reference text shipped with the standard library (nothing downloads), cut into
  (input, next-character) windows by `char_windows`;
- dropout keys from the step: `needs_rng=True` hands `loss_fn` a key derived from (seed,
  micro-step, device), and the loss passes it to the model as `rngs=`;
- AdamW with a linear warmup and a cosine decay (`optax.warmup_cosine_decay_schedule`), after
  clipping the global gradient norm at 1.0; the schedule counts optimizer steps, not calls;
- gradient accumulation, `accum_steps=2, accum_sync="last"`: `step.micro_batches(global_batch)`
  splits each global batch of 128 windows into 2 micro-batches of 64 (16 per device on 4 devices);
  each device sums its gradients locally and the devices all-reduce once per optimizer step, so
  `metrics["loss"]` is NaN on the first call of each pair and the mean over all 128 on the second;
- evaluation on the host: the mean validation loss over held-out windows (train=False, no
  dropout), then a 200-character sample (temperature 0.8) from a prompt, decoded with
  `corpus.decode`.

At the end it prints (measured on a 2-core CPU: about 70 s in all with the default 600 steps, 12 s
with `--steps 30`, which ends at val loss 2.84):

    val loss 1.724 (initial 5.414, ln(vocab) = 4.635) over 256 windows of 64
    sample (temperature 0.8):
    The value of alss carguments and of in a characes are retation a as and the ring "00.0x"" only
        (yackes in the "-cause function "istanc" becoptional in "bute", bary" allede by inditeration the
    starach implay ha

The initial loss is above ln(vocab), the loss of a uniform guess, because the untrained output
layer gives confident random logits; training brings it well below.
"""
import argparse
import math
import time

import jdp

jdp.cpu.use_cpu_devices(4)  # before any jax computation

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jdp.data import char_windows, load_char_corpus, make_batches  # noqa: E402
from jdp.models import GPT, functional, param_count  # noqa: E402

CONTEXT = 64
GLOBAL_BATCH = 128  # windows per optimizer step: 2 micro-batches of 64, 16 per device on 4 devices
ACCUM_STEPS = 2
PEAK_LR = 3e-3
VAL_WINDOWS = 256  # the first 256 non-overlapping windows of the validation text (16k characters)
PROMPT = "The value of "
SAMPLE_CHARS = 200
TEMPERATURE = 0.8

corpus = load_char_corpus()
model = GPT(corpus.vocab_size, CONTEXT, d_model=64, n_heads=4, n_layers=2, dropout=0.1, rngs=nnx.Rngs(0))
fm = functional(model)


def loss_fn(params, batch, rng):
    """Mean next-character cross-entropy over this device's windows and positions, with dropout."""
    logits = fm.apply(params, batch["x"], train=True, rngs=rng)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@jax.jit
def eval_loss(params, x, y):
    """Mean cross-entropy of windows x, y (k, CONTEXT) without dropout."""
    logits = fm.apply(params, x, train=False)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def val_loss(params, val) -> float:
    """The mean loss over the first VAL_WINDOWS validation windows, in chunks of 64."""
    n = min(VAL_WINDOWS, len(val))
    losses = [eval_loss(params, val.arrays["x"][i:i + 64], val.arrays["y"][i:i + 64]) for i in range(0, n, 64)]
    sizes = [min(64, n - i) for i in range(0, n, 64)]
    return float(np.average(np.array(losses), weights=sizes))


@jax.jit
def next_logits(params, window, position):
    """Logits at `position` of a (1, CONTEXT) window: causal, so tokens after it do not matter."""
    return fm.apply(params, window, train=False)[0, position]


def sample(params, prompt: str, length: int, key) -> str:
    """`length` characters after `prompt`, drawn at TEMPERATURE; one compiled shape (1, CONTEXT)."""
    tokens = list(corpus.encode(prompt))
    for _ in range(length):
        recent = tokens[-CONTEXT:]
        window = np.zeros((1, CONTEXT), np.int32)
        window[0, :len(recent)] = recent  # right-padded while shorter than the context
        logits = next_logits(params, window, len(recent) - 1)
        key, sub = jax.random.split(key)
        tokens.append(int(jax.random.categorical(sub, logits / TEMPERATURE)))
    return corpus.decode(tokens)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps (default 600)")
    args = parser.parse_args()
    steps = args.steps
    if steps < 1:
        parser.error(f"--steps must be at least 1, got {steps}")
    warmup = max(1, min(30, steps // 10))

    train = char_windows(corpus.train, CONTEXT, stride=CONTEXT // 2)
    val = char_windows(corpus.val, CONTEXT, stride=CONTEXT)
    schedule = optax.warmup_cosine_decay_schedule(0.0, PEAK_LR, warmup_steps=warmup, decay_steps=steps,
                                                  end_value=PEAK_LR / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))
    step = jdp.make_train_step(loss_fn, optimizer, needs_rng=True, accum_steps=ACCUM_STEPS, accum_sync="last")
    state = step.init(fm.params, seed=0)
    print(f"{step.num_devices} devices, GPT with {param_count(model):,} params, vocab {corpus.vocab_size}, "
          f"{len(train):,} train windows; {steps} optimizer steps of {GLOBAL_BATCH} windows "
          f"= {ACCUM_STEPS} micro-batches of {GLOBAL_BATCH // ACCUM_STEPS}")
    initial = val_loss(fm.params, val)
    print(f"initial val loss {initial:.3f} (ln(vocab) = {math.log(corpus.vocab_size):.3f})")

    batches = make_batches(train, GLOBAL_BATCH, seed=0)
    start = time.perf_counter()
    for i in range(steps):
        for micro in step.micro_batches(next(batches)):
            state, metrics = step(state, micro)
        if (i + 1) % 50 == 0 or i + 1 == steps:
            # metrics come from the second micro-batch call, the one that applied the update
            print(f"step {int(metrics['step']):4d}  train loss {float(metrics['loss']):.3f}  "
                  f"lr {float(schedule(i)):.2e}  ({time.perf_counter() - start:.0f} s)")
    batches.close()

    params = jdp.get_params(state)
    loss = val_loss(params, val)
    print(f"val loss {loss:.3f} (initial {initial:.3f}, ln(vocab) = {math.log(corpus.vocab_size):.3f}) "
          f"over {min(VAL_WINDOWS, len(val))} windows of {CONTEXT}")
    text = sample(params, PROMPT, SAMPLE_CHARS, jax.random.key(0))
    print(f"sample (temperature {TEMPERATURE}):")
    print(text)
    return loss


if __name__ == "__main__":
    main()
