"""`jdp.models.generate` on the Llama family: the kv-heads-only cache against the whole forward pass per
token and against transformers' own greedy `generate`, on the four tiny checkpoints of
tests/llama_checkpoints.py (tied + GQA; untied, llama3 rope scaling, head_dim ≠ hidden / heads; Qwen2
biases with one kv head; Mistral)."""
import numpy as np
import pytest
import torch
from flax import nnx

from jdp.models import from_hf
from jdp.models.decode import generate, greedy_reference, init_cache
from llama_checkpoints import KINDS, VOCAB, hf_model

PROMPTS = [[5, 17, 33, 2], [9], [40, 41, 42, 43, 44, 45, 46]]  # left padding of 3, 6 and 0 slots
NEW = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{kind: (transformers model, folder)}; the head scaled up so that greedy picks are not near-ties."""
    root, out = tmp_path_factory.mktemp("llama_decode"), {}
    for kind in KINDS:
        hf = hf_model(kind)
        with torch.no_grad():  # the blocks' outputs large against the embedding, or a tied head echoes each token
            for name, p in hf.named_parameters():
                if name.endswith("proj.weight"):
                    p.mul_(6.0)
            if not hf.config.tie_word_embeddings:
                hf.lm_head.weight.mul_(30.0)
        hf.save_pretrained(root / kind)
        out[kind] = (hf, str(root / kind))
    return out


def hf_greedy(hf, prompt) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt], dtype=torch.long)
        done = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                           pad_token_id=0, eos_token_id=None)
    return done[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_tokens_equal_transformers_generate_and_the_whole_forward_pass(models, kind):
    hf, path = models[kind]
    ours = from_hf(path)
    cached = generate(ours, PROMPTS, NEW, temperature=0.0)
    np.testing.assert_array_equal(cached, greedy_reference(ours, PROMPTS, NEW))
    theirs = np.array([hf_greedy(hf, p) for p in PROMPTS], np.int32)  # each row alone: no padding there
    np.testing.assert_array_equal(cached, theirs)
    assert len({tuple(row) for row in theirs}) == len(PROMPTS)  # each prompt its own continuation


def test_the_cache_holds_the_kv_heads_only_and_the_scanned_model_decodes_the_same(models):
    hf, path = models["llama_untied_llama3"]
    ours = from_hf(path)
    cache = init_cache(ours, 3, 10)
    a = ours.arch
    assert a.n_kv_heads < a.n_heads
    assert cache.k.shape == cache.v.shape == (a.n_layers, 3, 10, a.n_kv_heads, a.head_dim)
    scanned = from_hf(path, scan_layers=True)
    np.testing.assert_array_equal(generate(scanned, PROMPTS, NEW, temperature=0.0),
                                  generate(ours, PROMPTS, NEW, temperature=0.0))


def test_sampling_knobs_run_and_one_key_gives_the_same_tokens(models):
    ours = from_hf(models["qwen2"][1])
    draw = lambda seed: generate(ours, PROMPTS, NEW, temperature=0.8, top_k=20, top_p=0.9,  # noqa: E731
                                 key=__import__("jax").random.key(seed))
    first = draw(1)
    assert first.shape == (3, NEW) and first.min() >= 0 and first.max() < VOCAB
    np.testing.assert_array_equal(first, draw(1))
    assert not np.array_equal(first, draw(2))
