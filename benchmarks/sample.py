"""Decoding speed of `jdp.models.generate`: new tokens per second with the key/value cache, against a
compiled loop without one (the whole forward pass over the context for every new token, as
`greedy_reference` runs it) and against Hugging Face `transformers`' `generate` on a `GPT2LMHeadModel`
holding the same weights (`benchmarks.sample_peer`), on one device, compilation left out.

    python -m benchmarks.sample              # char_gpt's shape, a wider one, and gpt2_small's (86M)
    python -m benchmarks.sample --repeats 5
    python -m benchmarks.sample --dry-run    # one tiny model, one repeat: every path runs (the GPU check's)
    python -m benchmarks.sample --no-peer    # jdp alone (transformers and torch not needed)

Each model is a random GPT-2-shaped initialisation (speed does not depend on the params): greedy, one
prompt token per row, `new` tokens each; the median of `--repeats` runs. "cache bytes" and "temp / cache"
come from the compiled decode (`memory_analysis`): XLA's temporary buffers over the bytes of the
(n_layers, batch, slots, heads, head_dim) key and value caches; a loop that copied the cache per token
holds extra cache-sized buffers. "logits vs HF" is the largest difference between jdp's and the
peer's logits for one prompt (float32).
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

from jdp.models.decode import _decode, _prepared, compiled_generate

from benchmarks.sample_peer import gpt2_shaped

# (name, (vocab, context, d_model, heads, layers), batches, new tokens, uncached: time the loop without a cache).
# The uncached loop of the wider model at batch 8 did not finish in 30 minutes on a loaded 2-core CPU, and
# gpt2_small's would run 1024 positions per token: they are left out.
MODELS = (("char_gpt", (103, 64, 64, 4, 2), (1, 8), 63, True),
          ("d256_l4_ctx256", (256, 256, 256, 8, 4), (1,), 255, True),
          ("gpt2_small", (103, 1024, 768, 12, 12), (2,), 64, False))
DRY_RUN = (("tiny", (64, 16, 32, 2, 2), (1, 2), 15, True),)
# Each model runs unscanned, then scanned (its layers in one lax.scan, the cache carried through it): the
# same params, so the same tokens.
LAYOUTS = (("", False), (", scanned", True))


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


def cache_memory(model, prompts, new: int) -> tuple[int, float]:
    """(bytes of the key and value caches, the compiled decode's temporary bytes / those bytes)."""
    compiled = _decode.lower(*_prepared(model, prompts, new, 0.0, None, None, None)).compile()
    attn = (model.layers if model.scan_layers else model.blocks[0]).attn
    cache = 2 * model.n_layers * len(prompts) * (len(prompts[0]) + new - 1) * attn.num_heads * attn.head_dim * 4
    return cache, compiled.memory_analysis().temp_size_in_bytes / cache


def _uncached(model, prompts, new: int, repeats: int) -> tuple[float, np.ndarray]:
    graphdef, state = nnx.split(model)
    tokens = np.zeros((len(prompts), model.context), np.int32)
    tokens[:, 0] = [p[0] for p in prompts]
    plain = _without_cache.lower(graphdef, state, tokens, new).compile()  # writes tokens 1 .. new
    return _median_seconds(lambda: plain(state, tokens), repeats), np.asarray(plain(state, tokens))[:, 1:new + 1]


def _peer(model, prompts, new: int, repeats: int) -> tuple[float, np.ndarray, float]:
    """(seconds, tokens, largest |logit difference| on the first prompt) of transformers' generate."""
    import torch

    from benchmarks.sample_peer import hf_gpt2_from, hf_greedy

    hf = hf_gpt2_from(model)
    ids = np.asarray(prompts)
    window = np.arange(min(model.context, 16))[None] % model.vocab_size
    with torch.no_grad():
        theirs = hf(torch.from_numpy(window.astype(np.int64))).logits.numpy()
    gap = float(np.abs(theirs - np.asarray(model(jnp.asarray(window, jnp.int32), train=False))).max())
    hf_greedy(hf, ids, 2)  # warm up
    return _median_seconds(lambda: hf_greedy(hf, ids, new), repeats), hf_greedy(hf, ids, new), gap


def measure(shape, batch: int, new: int, repeats: int, uncached: bool, peer: bool, scan: bool) -> dict:
    """One row: tokens/s with the cache, without it (absent: not run) and of the peer (absent: not run)."""
    model = gpt2_shaped(*shape, scan_layers=scan)
    prompts = [[i % shape[0]] for i in range(batch)]
    cached = compiled_generate(model, prompts, new, temperature=0.0)
    mine = cached()
    n = batch * new
    row = {"batch": batch, "new_tokens": new, "cached_tokens_per_s": n / _median_seconds(cached, repeats)}
    row["cache_bytes"], row["temp_over_cache"] = cache_memory(model, prompts, new)
    if uncached:
        seconds, theirs = _uncached(model, prompts, new, repeats)
        # A random model's logits are nearly uniform: rounding may flip an argmax, so this is reported, not required.
        row.update(uncached_tokens_per_s=n / seconds, same_uncached=bool((theirs == mine).all()))
    if peer:
        seconds, theirs, gap = _peer(model, prompts, new, repeats)
        row.update(peer_tokens_per_s=n / seconds, same_peer=bool((theirs == mine).all()), logit_gap=gap)
    return row


def _cell(row, key, fmt=None) -> str:
    value = row.get(key)
    if value is None or isinstance(value, bool):
        return {None: "—", True: "yes", False: "no"}[value]
    return fmt.format(value) if fmt else f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="one tiny model, one repeat: check that every path runs")
    parser.add_argument("--no-peer", action="store_true", help="leave out Hugging Face transformers' generate")
    args = parser.parse_args(argv)
    models, repeats = (DRY_RUN, 1) if args.dry_run else (MODELS, args.repeats)
    device = jax.devices()[0]
    print(f"{device.platform}: {device.device_kind}\n\n| model | batch | new tokens | tokens/s, cache | tokens/s, no "
          f"cache | tokens/s, HF generate | cache / HF | same tokens (no cache, HF) | logits vs HF | cache bytes "
          f"| temp / cache |\n" + "|---" * 11 + "|")
    for (name, shape, batches, new, uncached), (suffix, scan) in ((m, layout) for m in models for layout in LAYOUTS):
        for batch in batches:
            # The scanned rows time jdp's cache alone: the loop without it and the peer are the unscanned rows'.
            r = measure(shape, batch, new, repeats, uncached and not scan, not (args.no_peer or scan), scan)
            ratio = r["cached_tokens_per_s"] / r["peer_tokens_per_s"] if "peer_tokens_per_s" in r else None
            print(f"| {name}{suffix} | {batch} | {new} | {_cell(r, 'cached_tokens_per_s')} | {_cell(r, 'uncached_tokens_per_s')} "
                  f"| {_cell(r, 'peer_tokens_per_s')} | {_cell({'x': ratio}, 'x', '{:.2f}×')} | "
                  f"{_cell(r, 'same_uncached')}, {_cell(r, 'same_peer')} | {_cell(r, 'logit_gap', '{:.1e}')} | "
                  f"{r['cache_bytes']:,} | {r['temp_over_cache']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
