"""`jdp.models.generate`: the cached, compiled decode loop against the whole forward pass per token, and
sampling checked on its defining properties. One tiny GPT per layout, its params drawn large so that
its next-token distributions are far from uniform (a random init's near-ties would make greedy a coin)."""
import jax
import numpy as np
import pytest
from flax import nnx

from jdp.models import GPT
from jdp.models.decode import filter_logits, generate, greedy_reference, pick

VOCAB, CONTEXT = 13, 12
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]  # three lengths: left padding of 2, 4 and 0 slots
NEW = 6


def tiny_gpt(scan_layers: bool) -> GPT:
    model = GPT(VOCAB, CONTEXT, d_model=16, n_heads=2, n_layers=2, dropout=0.0, scan_layers=scan_layers,
                rngs=nnx.Rngs(0))
    # Embeddings and head 40× their init (std 0.02 -> 0.8): next-token logits that differ by whole units.
    # The scanned GPT is the same model (its layers are made from the same Rngs, then stacked).
    for layer in (model.tok_embed.embedding, model.pos_embed.embedding, model.head.kernel):
        layer[...] = layer[...] * 40
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_gpt(False)


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unscanned", "scanned"])
def test_greedy_equals_the_whole_forward_pass_per_token(scan_layers, model):
    m = model if not scan_layers else tiny_gpt(True)
    cached = generate(m, PROMPTS, NEW, temperature=0.0)
    reference = greedy_reference(m, PROMPTS, NEW)
    assert cached.shape == (3, NEW) and cached.dtype == np.int32
    np.testing.assert_array_equal(cached, reference)
    assert len({tuple(row) for row in reference}) == 3 and len(set(reference.ravel())) > 3  # not one token repeated
    # Each row continues as it would alone: its padding is invisible, its positions start at its first token.
    np.testing.assert_array_equal(generate(m, [PROMPTS[1]], NEW, temperature=0.0)[0], cached[1])


def test_sampling_is_reproducible_per_key_and_top_k_1_or_a_tiny_top_p_is_greedy(model):
    greedy = generate(model, PROMPTS, NEW, temperature=0.0)
    hot = dict(temperature=3.0)  # this model's distributions are peaked: at 1.0 a draw is nearly the argmax
    a = generate(model, PROMPTS, NEW, key=jax.random.key(7), **hot)
    np.testing.assert_array_equal(a, generate(model, PROMPTS, NEW, key=jax.random.key(7), **hot))
    assert not np.array_equal(a, generate(model, PROMPTS, NEW, key=jax.random.key(8), **hot))
    assert not np.array_equal(a, greedy)
    np.testing.assert_array_equal(generate(model, PROMPTS, NEW, top_k=1, key=jax.random.key(7), **hot), greedy)
    np.testing.assert_array_equal(generate(model, PROMPTS, NEW, top_p=1e-6, key=jax.random.key(7), **hot), greedy)


def test_filter_logits_keeps_the_top_k_and_the_nucleus():
    probs = np.array([[0.05, 0.5, 0.15, 0.3]], np.float32)
    logits = np.log(probs)
    kept = lambda k, p: np.isfinite(np.asarray(filter_logits(logits, np.int32(k), np.float32(p))))[0]  # noqa: E731
    assert kept(2, 1.0).tolist() == [False, True, False, True]
    assert kept(1, 1.0).tolist() == [False, True, False, False]
    assert kept(4, 1.0).all()
    assert kept(4, 0.7).tolist() == [False, True, False, True]  # 0.5 < 0.7: the 0.3 token reaches it
    assert kept(4, 0.5).tolist() == [False, True, False, False]
    assert kept(4, 0.9).tolist() == [False, True, True, True]  # 0.5 + 0.3 < 0.9: the 0.15 token too
    assert kept(2, 0.9).tolist() == [False, True, False, True]  # top-k first, then the nucleus of what is left


def test_draws_follow_softmax_of_logits_over_temperature_within_top_k():
    probs = np.array([0.05, 0.5, 0.15, 0.3])
    logits = np.tile(np.log(probs).astype(np.float32), (20000, 1))
    draw = jax.jit(lambda t, k: pick(logits, jax.random.key(3), t, k, np.float32(1.0)))
    for temperature, k, expected in [(1.0, 4, probs), (2.0, 4, np.sqrt(probs) / np.sqrt(probs).sum()),
                                     (1.0, 2, np.array([0, 0.5, 0, 0.3]) / 0.8)]:
        counts = np.bincount(np.asarray(draw(np.float32(temperature), np.int32(k))), minlength=4) / len(logits)
        np.testing.assert_allclose(counts, expected, atol=0.015)
        assert (counts[expected == 0] == 0).all()


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-1.0), "temperature=-1.0 must be 0 (greedy) or positive"),
    (dict(top_k=0), "top_k=0 must be an integer of at least 1"),
    (dict(top_p=0.0), "top_p=0.0 must be in (0, 1]"),
    (dict(top_p=1.5), "top_p=1.5 must be in (0, 1]"),
    (dict(max_new_tokens=0), "max_new_tokens=0 must be an integer of at least 1"),
    (dict(prompts=[[1, 13]]), "prompt 0 holds the token id 13; the model's vocabulary is 0..12"),
    (dict(prompts=[[1], []]), "prompt 1 has shape (0,); each prompt needs at least one token id"),
    (dict(prompts=[[1] * 8]), "a prompt of 8 tokens and 6 new tokens need 13 positions, more than the model's "
                              "context of 12; give at most 5 new tokens or a shorter prompt"),
    (dict(prompts=[1, 2]), "prompts must be a non-empty list of token-id lists"),
])
def test_bad_values_are_refused_in_one_sentence(kwargs, message, model):
    args = {"prompts": PROMPTS, "max_new_tokens": NEW, **kwargs}
    with pytest.raises(ValueError) as e:
        generate(model, args.pop("prompts"), args.pop("max_new_tokens"), **args)
    assert message in str(e.value)


def test_a_nanogpt_shaped_gpt_decodes_as_its_whole_forward_pass():
    """Tied embeddings (no head: the logits are the embedding's transpose), no biases and the exact GELU
    (nanoGPT's architecture) go through the cached decode as through the model's own forward pass."""
    m = GPT(VOCAB, CONTEXT, d_model=16, n_heads=2, n_layers=2, dropout=0.0, bias=False, tie_embeddings=True,
            gelu_approximate=False, ln_epsilon=1e-5, rngs=nnx.Rngs(0))
    for layer in (m.tok_embed.embedding, m.pos_embed.embedding):
        layer[...] = layer[...] * 40
    np.testing.assert_array_equal(generate(m, PROMPTS, NEW, temperature=0.0), greedy_reference(m, PROMPTS, NEW))


def test_each_new_token_is_drawn_with_its_own_key_fold_in_key_i():
    """Token i is drawn with fold_in(key, i): checked against a loop that draws each token from the whole
    forward pass with that key. A random init's next-token distributions are near uniform, so at temperature 1
    the draw is decided by the key: one key for every token would repeat one token per row."""
    m = GPT(VOCAB, CONTEXT, d_model=16, n_heads=2, n_layers=2, dropout=0.0, rngs=nnx.Rngs(1))
    key, knobs = jax.random.key(5), (np.float32(1.0), np.int32(VOCAB), np.float32(1.0))
    drawn = generate(m, PROMPTS[:2], NEW, temperature=1.0, key=key)
    assert all(len(set(row)) > 2 for row in drawn)  # near-uniform draws: not one token repeated
    rows = [list(p) for p in PROMPTS[:2]]
    for i in range(NEW):  # each row's last logits from its own whole forward pass, drawn as one batch
        logits = np.concatenate([m(np.asarray([r], np.int32), train=False)[:, -1] for r in rows])
        for r, token in zip(rows, np.asarray(pick(logits, jax.random.fold_in(key, i), *knobs))):
            r.append(int(token))
    np.testing.assert_array_equal(drawn, [r[len(p):] for r, p in zip(rows, PROMPTS)])
