"""Flax NNX models, and the bridge from an `nnx.Module` to jdp's `(params, loss_fn)` form.

Models: `MLP`, `CNN` (BatchNorm; `sync_batchnorm=True` for global-batch statistics under
shard_map/pmap), `GPT` (dropout keys passed at call time; `attention="fused"`, `remat=True`;
nanoGPT's architecture through its options, and its weights through `gpt_from_nanogpt`; a Hugging
Face GPT-2 directory in through `gpt_from_hf` and out through `save_hf`;
`GPT.token_losses`: the per-token loss by `fused_cross_entropy`, a chunked head and softmax
cross-entropy that never builds the whole logits).
Text from a GPT: `generate` (a key/value cache and a compiled decode loop; greedy, temperature,
top-k, top-p), `greedy_reference` (the whole forward pass per token, its check).
Each takes `dtype=`, the compute dtype (`jdp.models.dtypes.compute_dtype`: None/float32 or
bfloat16): params float32, compute in `dtype`, logits float32.

Pure-function use. Split once, outside the step:

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

`params` (the `nnx.Param` leaves) is what jdp differentiates and updates; `rest` is every other
variable, e.g. the CNN's BatchNorm running averages (`nnx.BatchStat`). Inside the step, a stateful
call merges a fresh copy, runs it, and splits it again to read the state it wrote:

    # CNN, train: batch statistics; new_rest holds the updated running averages.
    logits, new_rest = apply_with_state(graphdef, params, rest, x, train=True)
    # CNN, eval: running averages from rest; new_rest equals rest.
    logits, _ = apply_with_state(graphdef, params, rest, x, train=False)
    # GPT, train: dropout masks from the key given here (rest is empty for GPT).
    logits, _ = apply_with_state(graphdef, params, rest, tokens, train=True, rngs=nnx.Rngs(dropout=key))

`new_rest` has the same structure as `rest`, so it can be carried in the train state and passed
to the next step; `params` never changes inside `apply_with_state`. Under `jax.grad`, return it
as auxiliary output: `loss_fn(params, rest, batch) -> (loss, new_rest)` with `has_aux=True`.
"""
import jax
from flax import nnx

from jdp.models.cnn import CNN
from jdp.models.decode import compiled_generate, generate, greedy_reference
from jdp.models.gpt import GPT
from jdp.models.hub import from_hf, gpt_from_hf, gpt_from_nanogpt, save_hf
from jdp.models.llama import Llama
from jdp.models.llama_arch import LlamaArchitecture
from jdp.models.mlp import MLP
from jdp.models.rope import RopeScaling
from jdp.models.nnx_bridge import FunctionalModel, apply_with_state, functional
from jdp.models.xent import fused_cross_entropy, plain_cross_entropy


def param_count(model: nnx.Module) -> int:
    """The number of scalar parameters: elements of every `nnx.Param` (not BatchNorm statistics)."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


__all__ = ["CNN", "GPT", "Llama", "LlamaArchitecture", "MLP", "FunctionalModel", "RopeScaling", "apply_with_state",
           "compiled_generate", "from_hf", "functional", "fused_cross_entropy", "generate", "gpt_from_hf",
           "gpt_from_nanogpt", "greedy_reference", "param_count", "plain_cross_entropy", "save_hf"]
