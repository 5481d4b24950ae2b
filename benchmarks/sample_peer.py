"""The peer of `benchmarks.sample`: Hugging Face `transformers`' `generate` (its own key/value cache) on a
`GPT2LMHeadModel` holding the same weights as a GPT-2-shaped `jdp.models.GPT`.

A jdp GPT is GPT-2's architecture when it has tied embeddings, biases, the tanh GELU and LayerNorm
epsilon 1e-5 (`gpt2_shaped`). `hf_gpt2_from(model)` copies its params: GPT-2's `Conv1D` stores
(in, out) kernels as nnx does, its attention one (d_model, 3 d_model) matrix of q | k | v columns,
head-major. `hf_greedy(hf, prompts, new)` decodes with `do_sample=False` and the cache on; the
tokens are compared with jdp's, and the timing is the median of a few calls (torch on CPU, its
default threads).
"""
from __future__ import annotations

import numpy as np
from flax import nnx

from jdp.models import GPT


def gpt2_shaped(vocab: int, context: int, d_model: int, heads: int, layers: int, *, scan_layers: bool = False,
                seed: int = 0) -> GPT:
    """A randomly initialised jdp GPT with GPT-2's architecture (tied embeddings, biases, tanh GELU,
    LayerNorm epsilon 1e-5), eval-ready (dropout 0); scanned or not, the same params for a seed."""
    return GPT(vocab, context, d_model=d_model, n_heads=heads, n_layers=layers, dropout=0.0, tie_embeddings=True,
               ln_epsilon=1e-5, scan_layers=scan_layers, rngs=nnx.Rngs(seed))


def _blocks(model: GPT) -> list[dict]:
    """Each layer's params as a nested dict of numpy arrays, unscanned or scanned alike."""
    if not model.scan_layers:
        return [nnx.to_pure_dict(nnx.state(b, nnx.Param)) for b in model.blocks]
    stacked = nnx.to_pure_dict(nnx.state(model.layers, nnx.Param))
    import jax

    return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(model.n_layers)]


def hf_gpt2_from(model: GPT):
    """A `transformers.GPT2LMHeadModel` (eval mode, float32) with `model`'s params; `model` must be
    `gpt2_shaped`. ValueError otherwise."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    block0 = model.layers if model.scan_layers else model.blocks[0]
    if not model.tie_embeddings or block0.fc.bias is None or not block0.gelu_approximate:
        raise ValueError("the Hugging Face peer needs a GPT-2-shaped jdp GPT (tie_embeddings=True, biases, the "
                         "tanh GELU): build it with benchmarks.sample_peer.gpt2_shaped.")
    d, heads = model.tok_embed.features, block0.attn.num_heads
    config = GPT2Config(vocab_size=model.vocab_size, n_positions=model.context, n_embd=d, n_layer=model.n_layers,
                        n_head=heads, activation_function="gelu_new", layer_norm_epsilon=model.ln_f.epsilon,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    hf = GPT2LMHeadModel(config).eval()
    t = lambda a: torch.from_numpy(np.array(a, np.float32))  # a writable copy  # noqa: E731
    sd = {"transformer.wte.weight": t(model.tok_embed.embedding[...]),
          "transformer.wpe.weight": t(model.pos_embed.embedding[...]),
          "transformer.ln_f.weight": t(model.ln_f.scale[...]), "transformer.ln_f.bias": t(model.ln_f.bias[...])}
    for i, p in enumerate(_blocks(model)):
        h, a = f"transformer.h.{i}.", p["attn"]
        qkv = [np.asarray(a[n]["kernel"]).reshape(d, d) for n in ("query", "key", "value")]
        sd.update({h + "ln_1.weight": t(p["ln1"]["scale"]), h + "ln_1.bias": t(p["ln1"]["bias"]),
                   h + "attn.c_attn.weight": t(np.concatenate(qkv, axis=1)),
                   h + "attn.c_attn.bias": t(np.concatenate([np.ravel(a[n]["bias"]) for n in ("query", "key", "value")])),
                   h + "attn.c_proj.weight": t(np.asarray(a["out"]["kernel"]).reshape(d, d)),
                   h + "attn.c_proj.bias": t(a["out"]["bias"]),
                   h + "ln_2.weight": t(p["ln2"]["scale"]), h + "ln_2.bias": t(p["ln2"]["bias"]),
                   h + "mlp.c_fc.weight": t(p["fc"]["kernel"]), h + "mlp.c_fc.bias": t(p["fc"]["bias"]),
                   h + "mlp.c_proj.weight": t(p["proj"]["kernel"]), h + "mlp.c_proj.bias": t(p["proj"]["bias"])})
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    left = [k for k in missing if k != "lm_head.weight"]  # tied to wte
    if left or unexpected:
        raise RuntimeError(f"the GPT-2 weights did not all load: missing {left}, unexpected {unexpected}")
    hf.tie_weights()
    return hf


def hf_greedy(hf, prompts: np.ndarray, new: int) -> np.ndarray:
    """Greedy continuation of `prompts` (b, P) int by `new` tokens with `hf.generate` (its key/value
    cache on, no early stop): (b, new) int32."""
    import torch

    ids = torch.from_numpy(np.asarray(prompts, np.int64))
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, use_cache=True, pad_token_id=0)
    return out[:, ids.shape[1]:].numpy().astype(np.int32)
