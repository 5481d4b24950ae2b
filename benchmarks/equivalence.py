"""max |Δparam| of jdp's step on N devices vs plain one-device JAX on the global batch.

  python -m benchmarks.equivalence            # MLP 12-16-16-5, 4 steps of global batch 32

Prints one row per optimizer and backend with the worst deviation over N ∈ {1, 2, 4, 8}.
"""
from __future__ import annotations

import jdp.cpu

jdp.cpu.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jdp  # noqa: E402

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw+clip": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1)),
}


def problem(seed=0, sizes=(12, 16, 16, 5), steps=4, global_batch=32):
    rng = np.random.default_rng(seed)
    params = {f"l{i}": {"w": rng.normal(0, 1 / np.sqrt(a), (a, b)).astype(np.float32), "b": np.zeros(b, np.float32)}
              for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}
    data = [{"x": rng.normal(size=(global_batch, sizes[0])).astype(np.float32),
             "y": rng.integers(0, sizes[-1], global_batch).astype(np.int32)} for _ in range(steps)]
    return params, data


def loss_fn(params, batch):
    h = batch["x"]
    for i in range(len(params)):
        h = h @ params[f"l{i}"]["w"] + params[f"l{i}"]["b"]
        if i < len(params) - 1:
            h = jnp.tanh(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()


def reference(make_opt, params, data):
    tx = make_opt()
    opt_state = tx.init(params)

    @jax.jit
    def step(p, o, b):
        g = jax.grad(loss_fn)(p, b)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    for batch in data:
        params, opt_state = step(params, opt_state, batch)
    return jax.device_get(params)


def main():
    params, data = problem()
    print(f"{'optimizer':12s} {'backend':10s} " + " ".join(f"{'N=' + str(n):>9s}" for n in (1, 2, 4, 8)))
    for name, make in OPTIMIZERS.items():
        ref = reference(make, params, data)
        for backend in ("shard_map", "pmap"):
            devs = []
            for n in (1, 2, 4, 8):
                step = jdp.make_train_step(loss_fn, make(), backend=backend, devices=jax.devices()[:n])
                state = step.init(params)
                for batch in data:
                    state, _ = step(state, batch)
                got = jdp.get_params(state)
                devs.append(max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))))
            print(f"{name:12s} {backend:10s} " + " ".join(f"{d:9.1e}" for d in devs))


if __name__ == "__main__":
    main()
