"""The fused, chunked cross-entropy against the plain one on a CPU: jdp's step on a GPT-2-shaped but small
GPT (nanoGPT's architecture: no bias, tied head, exact GELU), with `model.loss_chunk` 0 against N.

  python -m benchmarks.xent [--rounds R] [--steps S] [--vocab V] [--chunk N]

Both steps are `jdp.make_train_step` on one device, AdamW, the same params and batches. Reported: the
compiled step's temporary memory (XLA's `memory_analysis()`, deterministic) and the step time, timed
in R interleaved windows of S steps (the order shuffled per round), as the median of the per-round
ratios fused / plain with their interquartile range. Writes benchmarks/results/xent.md.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from benchmarks.common import ROOT, calls_timer, interleave, paired_ratio, ratio_spread, summary

SIZES = dict(context=256, d_model=128, n_heads=4, n_layers=2, batch=8)


def step_for(vocab: int, chunk: int):
    """(jdp step, initial state, placed batches) of the small GPT with `chunk` positions per loss block
    (0: the plain loss over the whole float32 logits)."""
    import jax
    import optax
    from flax import nnx

    import jdp
    from benchmarks.side_by_side_rows import mean_token_loss
    from jdp.models import GPT, functional

    s = SIZES
    fm = functional(GPT(vocab, s["context"], d_model=s["d_model"], n_heads=s["n_heads"], n_layers=s["n_layers"],
                        dropout=0.0, attention="fused", bias=False, tie_embeddings=True, gelu_approximate=False,
                        ln_epsilon=1e-5, rngs=nnx.Rngs(0)))

    loss_fn = mean_token_loss(fm, chunk)

    step = jdp.make_train_step(loss_fn, optax.adamw(3e-4, weight_decay=0.1), devices=jax.devices()[:1])
    rng = np.random.default_rng(0)
    placed = [step.shard_batch(rng.integers(0, vocab, (s["batch"], s["context"] + 1)).astype(np.int32))
              for _ in range(2)]
    return step, step.init(fm.params), placed


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.xent", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=16, help="positions per block of the fused loss")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "xent.md"))
    args = p.parse_args(argv)
    import jax

    runs, out = {}, {"sizes": {**SIZES, "vocab": args.vocab, "chunk": args.chunk}}
    for name, chunk in (("plain", 0), ("fused", args.chunk)):
        step, state, placed = step_for(args.vocab, chunk)
        out[f"{name}_temp_bytes"] = step.lower(state, placed[0]).compile().memory_analysis().temp_size_in_bytes
        run = calls_timer(step, state, placed)
        run(2)  # compile and warm up
        runs[name] = run
    times = interleave(runs, args.steps, args.rounds)
    out.update({name: summary(t) for name, t in times.items()})
    out["time_ratio_fused_over_plain"] = paired_ratio(times["fused"], times["plain"])
    out["time_ratio_spread"] = ratio_spread(times["fused"], times["plain"])
    out["temp_ratio_fused_over_plain"] = out["fused_temp_bytes"] / out["plain_temp_bytes"]
    s, spread = out["sizes"], out["time_ratio_spread"]
    text = (f"GPT (nanoGPT's architecture) vocab {s['vocab']}, context {s['context']}, {s['n_layers']} layers × "
            f"{s['d_model']}, batch {s['batch']} (float32, one CPU device of {jax.devices()[0].device_kind}), "
            f"fused chunk {s['chunk']} positions: temporary memory {out['plain_temp_bytes'] / 2**20:.1f} MiB plain, "
            f"{out['fused_temp_bytes'] / 2**20:.1f} MiB fused ({out['temp_ratio_fused_over_plain']:.2f}×); step "
            f"{out['plain']['median_step_s'] * 1e3:.0f} ms plain, {out['fused']['median_step_s'] * 1e3:.0f} ms fused, "
            f"fused / plain {out['time_ratio_fused_over_plain']:.2f}× (IQR {spread['q1']:.2f}–{spread['q3']:.2f}, "
            f"{args.rounds} rounds of {args.steps} steps).")
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(f"# Fused vs plain cross-entropy (python -m benchmarks.xent)\n\n{text}\n")
    return out


if __name__ == "__main__":
    main()
