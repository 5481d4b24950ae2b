"""Decoding speed of `jdp.models.generate`: new tokens per second with the key/value cache, against a
compiled loop without one (the whole forward pass over the context for every new token, as
`greedy_reference` runs it), on one device, compilation left out.

    python -m benchmarks.sample              # char_gpt's GPT, and a wider one
    python -m benchmarks.sample --repeats 5

Each model is a random initialisation (speed does not depend on the params); one prompt token per
row and the rest of the context filled with new tokens, greedily; the median of `--repeats` runs.
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdp.models import GPT
from jdp.models.decode import compiled_generate

# (name, vocab, context, d_model, heads, layers, batches): char_gpt's shape, and one 4× wider and deeper
# (batch 1 only: its uncached loop at batch 8 did not finish in 30 minutes on a loaded 2-core CPU)
MODELS = (("char_gpt", 103, 64, 64, 4, 2, (1, 8)), ("d256_l4_ctx256", 256, 256, 256, 8, 4, (1,)))


@partial(jax.jit, static_argnums=(0, 3))
def _without_cache(graphdef, state, tokens, new: int):
    """Greedy: for each new token the whole forward pass over `tokens` (b, context), its argmax
    written after the last real position (one real prompt token per row)."""
    def step(i, carry):  # the params ride in the carry: the GPT's call updates its params in place (nnx)
        tokens, params = carry
        logits = nnx.merge(graphdef, params)(tokens, train=False)  # (b, context, vocab): every position, every time
        return tokens.at[:, i + 1].set(jnp.argmax(logits[:, i], axis=-1).astype(jnp.int32)), params

    return jax.lax.fori_loop(0, new, step, (tokens, state))[0]


def _median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(vocab, context, d_model, heads, layers, batch: int, repeats: int) -> dict:
    model = GPT(vocab, context, d_model=d_model, n_heads=heads, n_layers=layers, dropout=0.0, rngs=nnx.Rngs(0))
    new = context - 1  # one prompt token, then the whole context
    prompts = [[i % vocab] for i in range(batch)]
    cached = compiled_generate(model, prompts, new, temperature=0.0)
    graphdef, state = nnx.split(model)
    tokens = np.zeros((batch, context), np.int32)
    tokens[:, 0] = [p[0] for p in prompts]
    plain = _without_cache.lower(graphdef, state, tokens, new).compile()  # writes tokens 1 .. context - 1
    # A random model's logits are nearly uniform: rounding may flip an argmax, so this is reported, not required.
    same = bool((np.asarray(plain(state, tokens))[:, 1:] == cached()).all())
    with_cache = _median_seconds(cached, repeats)
    without = _median_seconds(lambda: plain(state, tokens), repeats)
    n = batch * new
    return {"batch": batch, "new_tokens": new, "cached_tokens_per_s": n / with_cache,
            "uncached_tokens_per_s": n / without, "speedup": without / with_cache, "same_tokens": same}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    print(f"{device.platform}: {device.device_kind}\n\n| model | batch | new tokens | tokens/s, cache | tokens/s, no cache "
          f"| speed-up | same tokens |\n|---|---|---|---|---|---|---|")
    for name, *shape, batches in MODELS:
        for batch in batches:
            r = measure(*shape, batch=batch, repeats=args.repeats)
            print(f"| {name} | {batch} | {r['new_tokens']} | {r['cached_tokens_per_s']:,.0f} | "
                  f"{r['uncached_tokens_per_s']:,.0f} | {r['speedup']:.1f}× | {'yes' if r['same_tokens'] else 'no'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
