# Flax's NNX MNIST tutorial, ported to jdp: the same CNN (BatchNorm, Dropout), optimizer, loss and
# loop, trained data-parallel on 4 devices, on scikit-learn's bundled 8x8 digits instead of MNIST.
#
#     python -m jdp.examples.flax_nnx_tutorial      # about 20 s on a 2-core CPU; test accuracy about 0.98
#
# The tutorial: docs_nnx/mnist_tutorial.md in google/flax (Apache-2.0) as of Flax 0.12.0, its code
# cells in order without the pip cell (164 lines, 133 non-blank), with `optimizer.update(model, grads)`
# as Flax >= 0.11 requires it. Below this header, 102 of those lines are unchanged; `diff` against
# them removes 62 lines and adds 31:
#   jdp (13 -> 11): `import jdp` and `jdp.cpu.use_cpu_devices(4)`; loss_fn returns {'accuracy': ...}
#     instead of the logits (jdp averages aux over devices, so it must hold scalars), so the
#     MultiMetric averages that accuracy and eval_step passes it on (4 lines); the 7-line nnx.jit
#     train_step becomes jdp.nnx.make_train_step + init (2); in the loop, `model.train()` and the
#     train_step call become the jdp call and a metrics.update (2); jdp.nnx.update_model before
#     evaluating (1). jdp trains its own copy of `model`, made in train mode when the step is built,
#     so `model.train()` has nothing to switch. The evaluation stays the tutorial's, on one device
#     (`train_step.evaluate(state, metric_fn, data)` would evaluate data-parallel instead).
#   digits instead of MNIST (27 -> 12): 24 lines of TFDS loading -> 9 lines; `.as_numpy_iterator()`
#     gone from 3 lines (the batches are lists of numpy dicts).
#   the 8x8 input (2 -> 2): linear1 takes 2*2*64 = 256 inputs, not 7*7*64 = 3136; the example
#     input is (1, 8, 8, 1).
#   the time budget (2 -> 2): train_steps 1200 -> 300, eval_every 200 -> 100.
#   a script, not a notebook (18 -> 4): the matplotlib plots of the metrics and of 25 predictions
#     become prints.
import jdp  # Data parallelism: N devices take the step one device takes on the whole batch.
import numpy as np
from jdp.data import load_digits  # scikit-learn's 8x8 digits: bundled, nothing downloads.

jdp.cpu.use_cpu_devices(4)  # 4 devices (fake CPU devices on a CPU-only machine), before any JAX computation.
rng = np.random.default_rng(0)  # Set the random seed for reproducibility.

train_steps = 300
eval_every = 100
batch_size = 32

x_train, y_train, x_test, y_test = load_digits(images=True)  # (n, 8, 8, 1) float32 in [0, 1], int32 labels.

# Shuffle the training set every epoch and take `train_steps` batches; skip the incomplete test batch.
order = np.concatenate([rng.permutation(len(x_train)) for _ in range(train_steps * batch_size // len(x_train) + 1)])
train_ds = [{'image': x_train[i], 'label': y_train[i]} for i in order[:train_steps * batch_size].reshape(train_steps, -1)]
test_ds = [{'image': x_test[i:i + batch_size], 'label': y_test[i:i + batch_size]}
           for i in range(0, len(x_test) - batch_size + 1, batch_size)]

from flax import nnx  # The Flax NNX API.
from functools import partial

class CNN(nnx.Module):
  """A simple CNN model."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025, rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(256, 256, rngs=rngs)  # 8x8 -> 4x4 -> 2x2 (x 64): 256 inputs
    self.dropout2 = nnx.Dropout(rate=0.025, rngs=rngs)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x)))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.dropout2(self.linear1(x)))
    x = self.linear2(x)
    return x

# Instantiate the model.
model = CNN(rngs=nnx.Rngs(0))
# Visualize it.
nnx.display(model)

import jax.numpy as jnp  # JAX NumPy

y = model(jnp.ones((1, 8, 8, 1)))
y

import optax

learning_rate = 0.005
momentum = 0.9

optimizer = nnx.Optimizer(
  model, optax.adamw(learning_rate, momentum), wrt=nnx.Param
)
metrics = nnx.MultiMetric(
  accuracy=nnx.metrics.Average('accuracy'),  # jdp's aux: the batch accuracy
  loss=nnx.metrics.Average('loss'),
)

nnx.display(optimizer)

def loss_fn(model: CNN, batch):
  logits = model(batch['image'])
  loss = optax.softmax_cross_entropy_with_integer_labels(
    logits=logits, labels=batch['label']
  ).mean()
  return loss, {'accuracy': (logits.argmax(-1) == batch['label']).mean()}  # jdp: aux holds scalars

train_step = jdp.nnx.make_train_step(model, loss_fn, optimizer, has_aux=True)  # Trains a copy of model.
state = train_step.init(seed=0)  # The params, BatchNorm statistics and optimizer state, on every device.

@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
  loss, aux = loss_fn(model, batch)
  metrics.update(loss=loss, **aux)  # In-place updates.

metrics_history = {
  'train_loss': [],
  'train_accuracy': [],
  'test_loss': [],
  'test_accuracy': [],
}

for step, batch in enumerate(train_ds):
  # Run the optimization for one step and make a stateful update to the following:
  # - The train state's model parameters
  # - The optimizer state
  # - The training loss and accuracy batch metrics
  state, out = train_step(state, batch)  # The global batch, split over the devices.
  metrics.update(loss=out['loss'], **out['aux'])  # Means over the global batch.

  if step > 0 and (step % eval_every == 0 or step == train_steps - 1):  # One training epoch has passed.
    # Log the training metrics.
    for metric, value in metrics.compute().items():  # Compute the metrics.
      metrics_history[f'train_{metric}'].append(value)  # Record the metrics.
    metrics.reset()  # Reset the metrics for the test set.

    # Compute the metrics on the test set after each training epoch.
    jdp.nnx.update_model(model, state, optimizer)  # The trained params and BatchNorm statistics.
    model.eval() # Switch to eval mode
    for test_batch in test_ds:
      eval_step(model, metrics, test_batch)

    # Log the test metrics.
    for metric, value in metrics.compute().items():
      metrics_history[f'test_{metric}'].append(value)
    metrics.reset()  # Reset the metrics for the next training epoch.

    for dataset in ('train', 'test'):
      print(f"[{dataset}] step: {step}, loss: {metrics_history[f'{dataset}_loss'][-1]:.4f}, "
            f"accuracy: {metrics_history[f'{dataset}_accuracy'][-1] * 100:.2f}")

model.eval() # Switch to evaluation mode.

@nnx.jit
def pred_step(model: CNN, batch):
  logits = model(batch['image'])
  return logits.argmax(axis=1)

test_batch = test_ds[0]
pred = pred_step(model, test_batch)

print('predicted:', ''.join(map(str, pred[:25].tolist())), 'labels:', ''.join(map(str, test_batch['label'][:25])))
print(f"test accuracy {metrics_history['test_accuracy'][-1]:.4f}")

