"""Your own Flax NNX model, loss and arrays through jdp's full trainer.

    python -m jdp.examples.own_model_trainer [WORKDIR]

Checkpoints, exact resume (run it twice, or stop it with Ctrl-C and run it again), progress,
`WORKDIR/metrics.jsonl`, held-out evaluation and multi-process runs come from `jdp.train.train`;
the model, the loss and the arrays are yours. The config sets only what the trainer needs: batch
size, optimizer, steps and cadence (its model and data names are not used).
"""
import sys

import numpy as np
import optax
from flax import nnx

import jdp
from jdp.config import load_config
from jdp.train import train

jdp.cpu.use_cpu_devices(4)  # on a CPU-only machine; before any jax computation


class SmallCNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 16, (3, 3), use_bias=False, rngs=rngs)  # BatchNorm adds the bias
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.head = nnx.Linear(16 * 4 * 4, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(nnx.relu(self.bn(self.conv(x))), window_shape=(2, 2), strides=(2, 2))
        return self.head(self.dropout(x.reshape(x.shape[0], -1)))


def loss_fn(model, batch):  # for one device, as in Flax's tutorials
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["label"]).mean()}


def metric_fn(model, batch):  # per-example values, the model in eval mode
    logits = model(batch["image"])
    return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]),
            "accuracy": (logits.argmax(-1) == batch["label"]).astype(np.float32)}


def main(workdir: str = "runs/own_model", steps: int = 200):
    x, y, x_test, y_test = jdp.data.load_digits(images=True)
    task = jdp.nnx.task(SmallCNN(rngs=nnx.Rngs(0)), loss_fn, metric_fn, {"image": x, "label": y},
                        {"image": x_test, "label": y_test}, has_aux=True)
    config = load_config(None, [f"train.steps={steps}", "train.log_every=50", "train.checkpoint_every=50",
                                "optim.name=adamw", "optim.lr=5e-3", "data.batch_size=128"])
    result = train(config, workdir, task=task)  # a complete run trains nothing and evaluates its state again
    print(f"held-out accuracy {result.eval['accuracy']:.3f} after {result.steps} steps")
    return result


if __name__ == "__main__":
    main(*sys.argv[1:2])
