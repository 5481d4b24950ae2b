"""The "Why average?" seed example of docs/why-average.md, run through jdp's public API.

    python -m jdp.examples.seed_demo

`y = w·x`, mean-squared error, `w = 1`, SGD with `lr = 0.01`, `x = [2, 3, 1, 4]`, `t = [3, 5, 2, 6]`
(`jdp.data.load_seed_regression(1)`), one step each way:

- one device on the whole batch: gradient -8.5, w → 1.085;
- two devices, `[2, 3] | [1, 4]`, local gradients -8.0 and -9.0:
  `reduction="mean"` averages them to -8.5 (w → 1.085, the same step);
  `reduction="sum", lr_correction="none"` adds them to -17.0 (w → 1.17, twice the step);
  `reduction="sum", lr_correction="auto"` adds them and scales the update by 1/2, i.e. lr/2
  (w → 1.085 again: exact for SGD, whose update is linear in the gradient).

Then the two-parameter seed (`load_seed_regression(2)`: 8 examples, w = (0.5, -0.3), lr = 0.1) on
four devices of two examples each: mean → (0.915, 0.085), the one-device step; raw sum → (2.16, 1.24),
four times the step.

It uses `devices=jax.devices()[:n]`; with fewer than 4 accelerators it takes the 4 fake CPU devices
that `jdp.cpu.use_cpu_devices(4)` creates. It prints (about 2 s on a 2-core CPU):

    seed example: x = [2.0, 3.0, 1.0, 4.0], t = [3.0, 5.0, 2.0, 6.0], w = 1.0, lr = 0.01
    two devices' local gradients: -8.0 and -9.0

    setting                                    devices   gradient        w
    one device, whole batch                          1    -8.5000   1.0850
    mean (lax.pmean)                                 2    -8.5000   1.0850
    sum, lr_correction="none"                        2   -17.0000   1.1700
    sum, lr_correction="auto" (lr / 2)               2   -17.0000   1.0850

    two parameters, 4 devices: w = (0.5, -0.3), lr = 0.1
    one device          w -> (0.9150, 0.0850)
    mean                w -> (0.9150, 0.0850)
    sum, raw            w -> (2.1600, 1.2400)
"""
import jdp

jdp.cpu.use_cpu_devices(4)  # before any jax computation

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jdp.data import load_seed_regression  # noqa: E402


def loss_fn(params, batch):
    """The MEAN squared error of y = w·x over the examples given (one device's shard in the step)."""
    pred = batch["x"] @ params["w"] if batch["x"].ndim == 2 else batch["x"] * params["w"]
    return ((pred - batch["t"]) ** 2).mean()


def one_step(w0, data, lr, n, **reduce):
    """One SGD step from w0 on the whole of `data`, split over n devices; returns (w, gradient)."""
    devices = jax.devices() if jax.device_count() >= 4 else jax.devices("cpu")
    step = jdp.make_train_step(loss_fn, optax.sgd(lr), devices=devices[:n], **reduce)
    w0 = np.asarray(w0, np.float32)
    state, _ = step(step.init({"w": w0}), data)
    jdp.check_replicas(state)
    w = jdp.get_params(state)["w"]
    # The gradient the optimizer received, as the update shows it: (w - w0) / lr, undoing
    # "auto"'s 1/n scaling so that the table shows the reduced gradient itself.
    scale = n if reduce.get("lr_correction") == "auto" else 1
    return w, (w0 - w) / lr * scale


def main():
    seed = load_seed_regression(1).arrays
    x, t = seed["x"], seed["t"]
    local = [float(jax.grad(loss_fn)({"w": np.float32(1.0)}, {"x": x[i:i + 2], "t": t[i:i + 2]})["w"])
             for i in (0, 2)]
    print(f"seed example: x = {x.tolist()}, t = {t.tolist()}, w = 1.0, lr = 0.01")
    print(f"two devices' local gradients: {local[0]:.1f} and {local[1]:.1f}\n")

    rows = [("one device, whole batch", 1, {}),
            ("mean (lax.pmean)", 2, {"reduction": "mean"}),
            ('sum, lr_correction="none"', 2, {"reduction": "sum", "lr_correction": "none"}),
            ('sum, lr_correction="auto" (lr / 2)', 2, {"reduction": "sum", "lr_correction": "auto"})]
    print(f"{'setting':<42} {'devices':>7} {'gradient':>10} {'w':>8}")
    for name, n, reduce in rows:
        w, grad = one_step(1.0, seed, 0.01, n, **reduce)
        print(f"{name:<42} {n:>7} {float(grad):>10.4f} {float(w):>8.4f}")

    seed2 = load_seed_regression(2).arrays
    w0 = (0.5, -0.3)
    print(f"\ntwo parameters, 4 devices: w = {w0}, lr = 0.1")
    for name, n, reduce in [("one device", 1, {}), ("mean", 4, {"reduction": "mean"}),
                            ("sum, raw", 4, {"reduction": "sum", "lr_correction": "none"})]:
        w, _ = one_step(w0, seed2, 0.1, n, **reduce)
        print(f"{name:<19} w -> ({w[0]:.4f}, {w[1]:.4f})")


if __name__ == "__main__":
    main()
