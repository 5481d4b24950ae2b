"""jdp's GPT side by side with nanoGPT's (PyTorch, the `bench` extra): the same model, the same training.

The peer is karpathy/nanoGPT's `model.py`, vendored unchanged in benchmarks/nanogpt_peer/. Both
sides start from nanoGPT's initialisation (its `state_dict()` copied into jdp's GPT by
`jdp.models.gpt_from_nanogpt`), see the same batches (random windows of a seeded random token
stream, as nanoGPT's `get_batch` cuts them) and train with nanoGPT's train.py recipe in float32
without dropout: gradient clipping at norm 1.0, then AdamW with betas (0.9, 0.95), eps 1e-8 and weight
decay on the matrices only (nanoGPT's `configure_optimizers`: every param with dim >= 2; in jdp
the kernels and embeddings, since nnx keeps q/k/v biases as (heads, head_dim)). jdp's side is
`jdp.nnx.make_train_step` on one device; a hand-written `jax.jit` step of the same model and
optimizer runs too, to tell XLA's cost from jdp's own.

  python -m benchmarks.nanogpt [--threads K] [--rounds R] [--steps S]

pins both frameworks to the same K CPU cores (the process's CPU affinity, which binds every thread of
both, set before jax starts its thread pool; `torch.set_num_threads(K)`), compares the losses of the
first 20 steps, then times R interleaved windows of S steps each and writes
benchmarks/results/nanogpt.md (nanogpt_threads{K}.md for K > 1).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import sys
import time

import numpy as np

from benchmarks.common import ROOT, median, paired_ratio, ratio_spread

RESULTS = os.path.join(ROOT, "benchmarks", "results", "nanogpt{}.md")  # "" for one thread, else "_threads{K}"
# nanoGPT's shakespeare_char "baby GPT" (6 layers, 384 wide, 256 context, batch 64) scaled down to
# time in minutes on a 2-core CPU.
BENCH = dict(vocab=65, context=64, d_model=128, n_heads=4, n_layers=4, batch=12)
RECIPE = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), clip=1.0)


def peer_model(vocab: int, context: int, d_model: int, n_heads: int, n_layers: int, bias: bool = True,
               seed: int = 0):
    """nanoGPT's GPT (dropout 0) from `torch.manual_seed(seed)`, in float32 on the CPU."""
    import torch

    from benchmarks.nanogpt_peer.model import GPT, GPTConfig

    torch.manual_seed(seed)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its parameter count
        return GPT(GPTConfig(block_size=context, vocab_size=vocab, n_layer=n_layers, n_head=n_heads,
                             n_embd=d_model, dropout=0.0, bias=bias))


def token_batches(count: int, batch: int, context: int, vocab: int, seed: int = 0) -> list[tuple]:
    """`count` (x, y) int64 pairs of shape (batch, context): windows of one seeded token stream, y = x
    shifted by one (nanoGPT's `get_batch`). The stream is a Markov chain in which each token has 3
    possible successors, so there is something to learn and the loss falls."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, 3))
    choice = rng.integers(0, 3, size=20 * batch * context)
    data = np.empty(len(choice), dtype=np.int64)
    data[0] = 0
    for i in range(1, len(data)):
        data[i] = successors[data[i - 1], choice[i]]
    out = []
    for _ in range(count):
        start = rng.integers(0, len(data) - context - 1, size=batch)
        out.append((np.stack([data[i:i + context] for i in start]), np.stack([data[i + 1:i + 1 + context] for i in start])))
    return out


def peer_step(model, lr: float, weight_decay: float, betas, clip: float):
    """nanoGPT's train.py step on the CPU: `step(x, y) -> loss` (float, before the update)."""
    import torch

    with contextlib.redirect_stdout(io.StringIO()):
        optimizer = model.configure_optimizers(weight_decay, lr, betas, "cpu")
    model.train()

    def step(x, y):
        _, loss = model(torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def decay_mask(params):
    """True for the matrices nanoGPT decays (kernels, embeddings), False for biases and LayerNorm scales."""
    import jax

    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(getattr(k, "key", None) in ("kernel", "embedding") for k in path), params)


def jdp_step(state_dict, n_heads: int, lr: float, weight_decay: float, betas, clip: float):
    """jdp's GPT from nanoGPT's state dict, trained by `jdp.nnx.make_train_step` on one device with the
    same recipe: `(step, model)`, `step(x, y) -> loss` (float, before the update)."""
    import jax
    import optax

    import jdp
    from jdp.models import gpt_from_nanogpt

    model = gpt_from_nanogpt(state_dict, n_heads)

    def loss_fn(m, batch):
        return optax.softmax_cross_entropy_with_integer_labels(m(batch["x"]), batch["y"]).mean()

    tx = optax.chain(optax.clip_by_global_norm(clip),
                     optax.adamw(lr, b1=betas[0], b2=betas[1], eps=1e-8, weight_decay=weight_decay, mask=decay_mask))
    train = jdp.nnx.make_train_step(model, loss_fn, tx, devices=jax.devices()[:1])
    holder = {"state": train.init(seed=0)}

    def step(x, y):
        holder["state"], metrics = train(holder["state"], {"x": x.astype(np.int32), "y": y.astype(np.int32)})
        return float(metrics["loss"])

    return step, model


def jax_step(state_dict, n_heads: int, lr: float, weight_decay: float, betas, clip: float):
    """The same model and optimizer in a hand-written `jax.jit` step (no jdp): `step(x, y) -> loss`. It tells
    XLA's cost from jdp's own."""
    import jax
    import optax
    from flax import nnx

    from jdp.models import gpt_from_nanogpt

    graphdef, params = nnx.split(gpt_from_nanogpt(state_dict, n_heads), nnx.Param)
    tx = optax.chain(optax.clip_by_global_norm(clip),
                     optax.adamw(lr, b1=betas[0], b2=betas[1], eps=1e-8, weight_decay=weight_decay, mask=decay_mask))

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(nnx.merge(graphdef, p)(x), y).mean()

    @jax.jit
    def update(p, opt, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt, loss

    holder = {"state": (params, tx.init(params))}

    def step(x, y):
        p, opt, loss = update(*holder["state"], x.astype(np.int32), y.astype(np.int32))
        holder["state"] = (p, opt)
        return float(loss)

    return step


def losses_side_by_side(config: dict, steps: int = 20, bias: bool = True, seed: int = 0, with_jax: bool = False) -> dict:
    """Both sides (and with_jax, the hand-written jax step) from the same initialisation over the same `steps`
    batches: their initial logits and losses, and the step functions, which go on training."""
    import torch

    g = {k: config[k] for k in ("vocab", "context", "d_model", "n_heads", "n_layers")}
    peer = peer_model(**g, bias=bias, seed=seed)
    data = token_batches(steps, config["batch"], config["context"], config["vocab"], seed=seed)
    ours, model = jdp_step(peer.state_dict(), config["n_heads"], **RECIPE)
    with torch.no_grad():
        peer_logits = peer(torch.from_numpy(data[0][0]), torch.from_numpy(data[0][1]))[0].numpy()
    jdp_logits = np.asarray(model(data[0][0].astype(np.int32), train=False))
    plain = jax_step(peer.state_dict(), config["n_heads"], **RECIPE) if with_jax else None
    theirs = peer_step(peer, **RECIPE)
    out = {"peer_logits": peer_logits, "jdp_logits": jdp_logits,
           "peer_losses": [theirs(x, y) for x, y in data], "jdp_losses": [ours(x, y) for x, y in data],
           "peer": theirs, "jdp": ours, "jax": plain}
    if with_jax:
        out["jax_losses"] = [plain(x, y) for x, y in data]
    return out


def pin_threads(k: int) -> list[int]:
    """Run this process, every thread of torch and XLA, on its first `k` allowed CPUs, and give torch `k`
    threads. Call it before any jax computation: XLA sizes its CPU thread pool when its backend starts."""
    import torch

    cpus = sorted(os.sched_getaffinity(0))[:k]
    if len(cpus) < k:
        raise ValueError(f"--threads {k} is more than the {len(cpus)} CPUs this process may use.")
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(k)
    torch.set_num_interop_threads(k)
    return cpus


def _window(step, batches):
    def run(n):
        t0 = time.perf_counter()
        for i in range(n):
            step(*batches[i % len(batches)])  # float(loss) on both sides: each step ends synchronised
        return time.perf_counter() - t0

    return run


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    cpus = pin_threads(args.threads)
    import jax
    import torch

    load_before = os.getloadavg()
    t0 = time.perf_counter()
    side = losses_side_by_side(BENCH, with_jax=True)
    diff = np.abs(np.subtract(side["peer_losses"], side["jdp_losses"]))
    jax_diff = np.abs(np.subtract(side["peer_losses"], side["jax_losses"]))
    logits_diff = float(np.abs(side["peer_logits"] - side["jdp_logits"]).max())
    batches = token_batches(8, BENCH["batch"], BENCH["context"], BENCH["vocab"], seed=1)
    runs = {name: _window(side[key], batches) for name, key in (("nanoGPT", "peer"), ("jdp", "jdp"), ("jax", "jax"))}
    for run in runs.values():
        run(2)  # warm: jdp's step is compiled already, torch's allocator settles
    times = {name: [] for name in runs}
    order = np.random.default_rng(0)
    for r in range(args.rounds):
        for name in order.permutation(list(runs)):
            times[name].append(runs[name](args.steps) / args.steps)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.1f} ms" for n in runs),
              flush=True)
    spread = ratio_spread(times["nanoGPT"], times["jdp"])
    result = {
        "config": BENCH, "recipe": {**RECIPE, "betas": list(RECIPE["betas"])}, "threads": args.threads, "cpus": cpus,
        "rounds": args.rounds, "steps_per_window": args.steps,
        "max_loss_diff_20_steps": float(diff.max()), "max_initial_logits_diff": logits_diff,
        "max_loss_diff_20_steps_jax": float(jax_diff.max()),
        "ratio_jax_over_jdp": paired_ratio(times["jax"], times["jdp"]),
        "peer_losses": side["peer_losses"], "jdp_losses": side["jdp_losses"], "jax_losses": side["jax_losses"],
        "median_step_ms": {n: median(t) * 1e3 for n, t in times.items()},
        "ratio_nanogpt_over_jdp": paired_ratio(times["nanoGPT"], times["jdp"]), "ratio_q1": spread["q1"],
        "ratio_q3": spread["q3"], "load_before": load_before, "load_after": os.getloadavg(),
        "seconds": time.perf_counter() - t0, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "versions": {"jax": jax.__version__, "torch": torch.__version__, "python": platform.python_version()},
    }
    path = RESULTS.format("" if args.threads == 1 else f"_threads{args.threads}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(table(result))
    print(table(result))
    print("RESULT " + json.dumps({k: v for k, v in result.items() if not k.endswith("_losses")}))
    return result


def table(r: dict) -> str:
    """The markdown the docs quote: what ran, the parity numbers, the step times."""
    c, ms = r["config"], r["median_step_ms"]
    return (f"`python -m benchmarks.nanogpt --threads {r['threads']} --rounds {r['rounds']} --steps "
            f"{r['steps_per_window']}`, {r['date']} (jax {r['versions']['jax']}, torch {r['versions']['torch']}); "
            f"GPT {c['n_layers']} layers, d_model {c['d_model']}, {c['n_heads']} heads, context {c['context']}, "
            f"vocab {c['vocab']}, batch {c['batch']}, float32, {r['threads']} thread(s) on CPU {r['cpus']}; "
            f"load average {r['load_before'][0]:.1f} before, {r['load_after'][0]:.1f} after.\n\n"
            "| | nanoGPT (PyTorch) | jdp (`jdp.nnx.make_train_step`, 1 device) | hand-written `jax.jit` step |\n"
            "|---|---|---|---|\n"
            f"| median step time (ms), {r['rounds']} interleaved windows of {r['steps_per_window']} steps "
            f"| {ms['nanoGPT']:.1f} | {ms['jdp']:.1f} | {ms['jax']:.1f} |\n"
            f"| step time / jdp's (median of per-round ratios) | {r['ratio_nanogpt_over_jdp']:.2f} "
            f"(q1–q3 {r['ratio_q1']:.2f}–{r['ratio_q3']:.2f}) | 1 | {r['ratio_jax_over_jdp']:.2f} |\n"
            f"| loss at step 1 / step 20 | {r['peer_losses'][0]:.5f} / {r['peer_losses'][19]:.5f} "
            f"| {r['jdp_losses'][0]:.5f} / {r['jdp_losses'][19]:.5f} "
            f"| {r['jax_losses'][0]:.5f} / {r['jax_losses'][19]:.5f} |\n"
            f"| largest loss difference from nanoGPT's over 20 AdamW steps | — | {r['max_loss_diff_20_steps']:.1e} "
            f"| {r['max_loss_diff_20_steps_jax']:.1e} |\n"
            f"| largest initial logit difference from nanoGPT's | — | {r['max_initial_logits_diff']:.1e} | |\n")


if __name__ == "__main__":
    main(sys.argv[1:])
