"""The GPT's architecture options (bias, tie_embeddings, gelu_approximate, ln_epsilon) and
`gpt_from_nanogpt`'s mapping, each by its defining property and without PyTorch; the side-by-side
training against nanoGPT itself is tests/test_nanogpt_parity.py."""
import jax
import numpy as np
import pytest
from flax import nnx

from jdp.models import GPT, gpt_from_nanogpt, param_count

V, T, D, H, L = 13, 6, 8, 2, 2


def tokens(seed=0):
    return np.random.default_rng(seed).integers(0, V, (2, T)).astype(np.int32)


def leaf_names(model):
    return {str(path[-1]) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_the_architecture_options_do_what_they_say():
    """tie_embeddings: no head, the logits are ln_f(x) @ tok_embed.embedding.T (an untied GPT made from the
    same seed, its head set to that matrix, gives the same logits; scanned too); bias=False: no bias anywhere;
    ln_epsilon: every LayerNorm's; gelu_approximate=False: each block's MLP is exact erf GELU, which
    differs from the default tanh form."""
    x = tokens()
    tied = GPT(V, T, D, H, L, dropout=0.0, tie_embeddings=True, rngs=nnx.Rngs(0))
    untied = GPT(V, T, D, H, L, dropout=0.0, rngs=nnx.Rngs(0))
    assert not hasattr(tied, "head") and param_count(untied) - param_count(tied) == V * D
    untied.head.kernel[...] = tied.tok_embed.embedding[...].T
    np.testing.assert_allclose(tied(x, train=False), untied(x, train=False), atol=1e-6)
    scanned = GPT(V, T, D, H, L, dropout=0.0, tie_embeddings=True, scan_layers=True, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(scanned(x, train=False), tied(x, train=False), atol=1e-6)
    with pytest.raises(ValueError, match="ln_epsilon=0.0 must be positive"):
        GPT(V, T, D, H, L, ln_epsilon=0.0, rngs=nnx.Rngs(0))

    plain = GPT(V, T, D, H, L, dropout=0.0, bias=False, ln_epsilon=1e-5, rngs=nnx.Rngs(0))
    assert "bias" not in leaf_names(plain) and "bias" in leaf_names(untied)
    norms = [m for _, m in nnx.iter_graph(plain) if isinstance(m, nnx.LayerNorm)]
    assert len(norms) == 2 * L + 1 and {m.epsilon for m in norms} == {1e-5}
    assert {m.epsilon for _, m in nnx.iter_graph(untied) if isinstance(m, nnx.LayerNorm)} == {1e-6}

    exact = GPT(V, T, D, H, L, dropout=0.0, gelu_approximate=False, rngs=nnx.Rngs(0))
    block, h = exact.blocks[0], exact.tok_embed(x) + exact.pos_embed(np.arange(T))
    h = h + block.attn(block.ln1(h), mask=nnx.make_causal_mask(x), deterministic=True)
    by_hand = h + block.proj(jax.nn.gelu(block.fc(block.ln2(h)), approximate=False))
    np.testing.assert_allclose(block(exact.tok_embed(x) + exact.pos_embed(np.arange(T)), nnx.make_causal_mask(x),
                                     train=False, rngs=None), by_hand, atol=1e-6)
    assert np.abs(np.asarray(exact(x, train=False)) - np.asarray(untied(x, train=False))).max() > 1e-7


def nanogpt_state_dict(bias=True, tied=True, seed=0):
    """A nanoGPT `state_dict()` in numpy: random values of nanoGPT's names and (out, in) shapes."""
    rng = np.random.default_rng(seed)
    r = lambda *shape: rng.normal(0, 0.3, shape).astype(np.float32)  # noqa: E731
    sd = {"transformer.wte.weight": r(V, D), "transformer.wpe.weight": r(T, D), "transformer.ln_f.weight": r(D)}
    for i in range(L):
        p = f"transformer.h.{i}."
        for name, shape in (("ln_1", (D,)), ("ln_2", (D,)), ("attn.c_attn", (3 * D, D)), ("attn.c_proj", (D, D)),
                            ("mlp.c_fc", (4 * D, D)), ("mlp.c_proj", (D, 4 * D))):
            sd[p + name + ".weight"] = r(*shape)
            if bias:
                sd[p + name + ".bias"] = r(shape[0])
        sd[p + "attn.bias"] = np.tril(np.ones((T, T), np.float32))[None, None]  # the mask buffer: skipped
    if bias:
        sd["transformer.ln_f.bias"] = r(D)
    sd["lm_head.weight"] = sd["transformer.wte.weight"] if tied else r(V, D)
    return sd


@pytest.mark.parametrize("bias", [True, False])
def test_gpt_from_nanogpt_puts_each_matrix_where_nanogpt_uses_it(bias):
    """c_attn's rows are q | k | v, each head-major (nanoGPT's .split(n_embd).view(B, T, heads, head_dim)):
    each of jdp's projections of an input equals x @ W.T + b with nanoGPT's slice; c_proj, c_fc and the
    MLP's c_proj likewise; the model holds copies, not views of the state dict's memory; the tied head is
    the embedding, an untied one lm_head; a bad state dict is refused in one sentence."""
    sd = nanogpt_state_dict(bias)
    model = gpt_from_nanogpt(sd, H)
    x = np.random.default_rng(1).normal(size=(3, D)).astype(np.float32)
    lin = lambda name, v: v @ sd[name + ".weight"].T + (sd[name + ".bias"] if bias else 0)  # noqa: E731
    for i, block in enumerate(model.blocks):
        p = f"transformer.h.{i}."
        qkv = lin(p + "attn.c_attn", x)
        for j, proj in enumerate((block.attn.query, block.attn.key, block.attn.value)):
            np.testing.assert_allclose(np.asarray(proj(x)).reshape(3, D), qkv[:, j * D:(j + 1) * D], atol=1e-5)
        np.testing.assert_allclose(block.attn.out(x.reshape(3, H, D // H)), lin(p + "attn.c_proj", x), atol=1e-5)
        np.testing.assert_allclose(block.fc(x), lin(p + "mlp.c_fc", x), atol=1e-5)
        wide = np.random.default_rng(2).normal(size=(3, 4 * D)).astype(np.float32)
        np.testing.assert_allclose(block.proj(wide), lin(p + "mlp.c_proj", wide), atol=1e-5)
        np.testing.assert_array_equal(block.ln1.scale[...], sd[p + "ln_1.weight"])
    embedding = np.array(model.tok_embed.embedding[...])
    sd["transformer.wte.weight"][...] = 0.0  # as torch's optimizer changes its tensors in place
    np.testing.assert_array_equal(model.tok_embed.embedding[...], embedding)  # the model holds copies
    assert model.tie_embeddings and not hasattr(model, "head") and ("bias" in leaf_names(model)) == bias
    assert model.blocks[0].ln1.epsilon == 1e-5 and not model.blocks[0].gelu_approximate
    untied = gpt_from_nanogpt(nanogpt_state_dict(bias, tied=False), H)
    np.testing.assert_array_equal(untied.head.kernel[...], nanogpt_state_dict(bias, tied=False)["lm_head.weight"].T)
    with pytest.raises(ValueError, match="n_heads=3 must be positive and divide the state dict's d_model=8"):
        gpt_from_nanogpt(sd, 3)
    with pytest.raises(ValueError, match="entries a nanoGPT GPT does not"):
        gpt_from_nanogpt({**sd, "transformer.extra.weight": np.ones(3)}, H)
