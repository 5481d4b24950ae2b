"""Hugging Face GPT-2 checkpoints in (`jdp.models.gpt_from_hf`, `model.init_from`) and out
(`jdp.models.save_hf`, `jdp export`), against `transformers`' own GPT2LMHeadModel.

The checkpoints are small random-weight GPT-2s that transformers itself builds and saves (2 layers,
d_model 32, a byte-level BPE of 300 ids, 32 positions); their LayerNorm and bias params are moved off
their initial 1 and 0 so that every one of them changes the logits, and their MLP's inputs scaled up to
where the two GELUs differ. Two architectures: GPT-2's own
(tanh GELU, epsilon 1e-5, tied head) and the other options (exact GELU, epsilon 0.1, where a dropped
epsilon is visible, an untied head).
"""
import json
import os

import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from helpers import cli
from jdp.config import ConfigError, config_from_dict
from jdp.models import GPT, generate, gpt_from_hf, save_hf
from jdp.models.hub.safetensors_io import load as load_safetensors

VOCAB, POSITIONS = 300, 32
KINDS = {"gpt2": dict(activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True),
         "options": dict(activation_function="gelu", layer_norm_epsilon=0.1, tie_word_embeddings=False)}


def corpus(n_words=4000, seed=0) -> str:
    words = ["the", "model", "data", "parallel", "step", "device", "token", "jax", "loss", "batch", "of", "and",
             "every", "one", "takes", "exactly", "gradient", "mean", "sum", "global"]
    rng = np.random.default_rng(seed)
    return " ".join(words[i] for i in rng.integers(0, len(words), n_words)) + "\n"


def tokenizer_json(path, text):
    """A byte-level BPE of VOCAB ids (GPT-2's pre-tokenizer and byte alphabet), saved as a tokenizer.json."""
    import tokenizers as tk

    hf = tk.Tokenizer(tk.models.BPE())
    hf.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tk.decoders.ByteLevel()
    hf.train_from_iterator([text], tk.trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False,
                                                         initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
    assert hf.get_vocab_size() == VOCAB
    hf.save(str(path))


def gpt2(kind: str, seed: int = 0):
    """A random-weight transformers GPT2LMHeadModel (eval mode) of `kind`, its 1-D params perturbed."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=None, eos_token_id=None, **KINDS[kind])
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # LayerNorm scales/biases and Conv1D biases start at 1 and 0
                p.add_(0.2 * torch.randn_like(p))
            elif "c_fc" in name:  # GELU inputs of order 1, where its tanh and erf forms differ (~1e-3)
                p.mul_(20.0)
            elif "mlp.c_proj" in name:  # and the MLP's output large enough to carry that difference
                p.mul_(5.0)
    return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """{kind: (directory, model)}: each model saved by transformers, with the tokenizer.json beside it."""
    root = tmp_path_factory.mktemp("hf")
    tokenizer_json(root / "tokenizer.json", corpus())
    out = {}
    for kind in KINDS:
        model = gpt2(kind)
        model.save_pretrained(root / kind)
        (root / kind / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
        out[kind] = (str(root / kind), model)
    return out


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()


IDS = np.random.default_rng(1).integers(0, VOCAB, (2, POSITIONS))


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_transformers_gpt2_loads_with_its_logits(hf, kind):
    path, model = hf[kind]
    ours = gpt_from_hf(path)
    np.testing.assert_allclose(np.asarray(ours(IDS, train=False)), hf_logits(model, IDS), rtol=1e-5, atol=1e-6)
    assert ours.tie_embeddings == (kind == "gpt2") and not hasattr(ours, "head") == (kind == "gpt2")


@pytest.mark.parametrize("kind", list(KINDS))
def test_save_hf_writes_what_transformers_loads_with_the_same_logits_and_greedy_text(hf, kind, tmp_path):
    path, model = hf[kind]
    ours = gpt_from_hf(path, scan_layers=kind == "options")  # a scanned model's stacked layers are cut apart
    out = save_hf(ours, tmp_path / "export", tokenizer_file=os.path.join(path, "tokenizer.json"))
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    back = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    ref = np.asarray(ours(IDS, train=False))
    np.testing.assert_allclose(hf_logits(back, IDS), ref, rtol=1e-5, atol=1e-6)
    tied = kind == "gpt2"
    assert (back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr()) == tied
    assert ("lm_head.weight" in load_safetensors(os.path.join(out, "model.safetensors"))) == (not tied)
    prompt = IDS[:1, :5]
    with torch.no_grad():
        theirs = back.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(generate(ours, prompt.tolist(), 8, temperature=0.0)),
                                  theirs[:, 5:].numpy())


def test_a_gpt_without_biases_exports_with_zero_biases_and_the_same_logits(tmp_path):
    ours = GPT(VOCAB, POSITIONS, d_model=32, n_heads=2, n_layers=2, dropout=0.0, bias=False, rngs=nnx.Rngs(3))
    back = transformers.GPT2LMHeadModel.from_pretrained(save_hf(ours, tmp_path / "out")).eval()
    logits = np.asarray(ours(IDS, train=False))  # (its logits reach ~3: float32 rounding of ~4e-6)
    np.testing.assert_allclose(hf_logits(back, IDS), logits, rtol=1e-5, atol=1e-5)


def write_config(directory, **changes):
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


def test_what_is_not_a_gpt2_checkpoint_is_refused_in_one_sentence(hf, tmp_path):
    import shutil

    def copy(name, **changes):
        target = tmp_path / name
        shutil.copytree(hf["gpt2"][0], target)
        write_config(target, **changes)
        return target

    cases = [(tmp_path, "is not a Hugging Face model folder: it has no config.json"),
             (copy("llama", model_type="llama"), "has model_type 'llama', and gpt_from_hf reads 'gpt2'"),
             (copy("relu", activation_function="relu"), "activation_function 'relu' is not one jdp's GPT computes"),
             (copy("inner", n_inner=48), "n_inner=48; jdp's GPT has an MLP of 4 × n_embd = 128"),
             (copy("layer_idx", scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=True")]
    pickled = copy("bin")
    os.rename(pickled / "model.safetensors", pickled / "pytorch_model.bin")
    cases.append((pickled, "holds its weights as pytorch_model.bin, and jdp reads safetensors only"))
    for path, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            gpt_from_hf(path)


def test_save_hf_overwrites_nothing(hf, tmp_path):
    ours = gpt_from_hf(hf["gpt2"][0])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="is a directory that is not empty; jdp overwrites nothing"):
        save_hf(ours, tmp_path / "full")
    assert os.listdir(tmp_path / "full") == ["keep.txt"] and sorted(os.listdir(tmp_path)) == ["full"]
    (tmp_path / "empty").mkdir()
    assert sorted(os.listdir(save_hf(ours, tmp_path / "empty"))) == ["config.json", "model.safetensors"]
    with pytest.raises(ValueError, match="save_hf writes jdp's GPT and Llama models"):
        save_hf(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tmp_path / "other")


def test_model_init_from_takes_the_sizes_and_refuses_a_contradicting_one(hf, tmp_path):
    from jdp.run.tasks import gpt_for

    path, model = hf["options"]
    tokens = tmp_path / "train.bin"
    np.arange(200, dtype=np.uint16).tofile(tokens)
    data = {"name": "tokens", "path": str(tokens), "vocab_size": VOCAB}
    config = config_from_dict({"model": {"init_from": path, "dropout": 0.0}, "data": data})
    m = config.model
    assert (m.name, m.d_model, m.n_heads, m.n_layers, m.context) == ("gpt", 32, 2, 2, POSITIONS)
    np.testing.assert_allclose(np.asarray(gpt_for(config, VOCAB)(IDS, train=False)), hf_logits(model, IDS),
                               rtol=1e-5, atol=1e-6)  # what jdp train starts from
    assert config_from_dict({"model": {"init_from": path, "context": 16}, "data": data}).model.context == 16
    refused = [({"d_model": 64}, "model.d_model=64 contradicts model.init_from=.*, whose config.json has n_embd=32"),
               ({"n_layers": 3}, "model.n_layers=3 contradicts .* n_layer=2"),
               ({"context": 33}, "model.context=33 .* n_positions=32"),
               ({"name": "mlp"}, "needs model.name 'gpt', got 'mlp'")]
    for model_values, message in refused:
        with pytest.raises(ConfigError, match=message):
            config_from_dict({"model": {"init_from": path, **model_values}, "data": data})
    with pytest.raises(ConfigError, match=f"data.vocab_size=301 is more than .*'s vocab_size={VOCAB}"):
        config_from_dict({"model": {"init_from": path}, "data": {**data, "vocab_size": 301}})
    with pytest.raises(ConfigError, match="needs data.name 'tokens', got 'chars'"):
        config_from_dict({"model": {"init_from": path}, "data": {"name": "chars"}})


def test_jdp_export_refuses_a_full_output_and_a_workdir_without_a_checkpoint(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    r = cli(capsys, "export", tmp_path / "nowhere", tmp_path / "out")  # OUT is checked before the run is read
    assert r.returncode == 2 and "is a directory that is not empty; jdp overwrites nothing" in r.stderr, r.stderr
    r = cli(capsys, "export", tmp_path / "nowhere", tmp_path / "new")
    assert r.returncode == 2 and "holds no checkpoint" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(tmp_path / "out") == ["keep.txt"]


@pytest.mark.xdist_group("hf_cli")
def test_fine_tuning_end_to_end_prepare_train_sample_export(hf, tmp_path, capsys):
    """jdp's commands on a transformers checkpoint: the first step's loss is transformers' loss on that
    batch, and the export of the trained run is what jdp's trained model computes."""
    import jdp.data as D
    from jdp.run.sampling import load_run

    path, model = hf["gpt2"]
    (tmp_path / "corpus.txt").write_text(corpus(3000, seed=5))
    r = cli(capsys, "data", "prepare-tokens", tmp_path / "corpus.txt", tmp_path / "tokens", "--tokenizer",
            os.path.join(path, "tokenizer.json"), "--no-progress")
    assert r.returncode == 0, r.stderr
    work, context, batch = tmp_path / "work", 16, 16
    r = cli(capsys, "train", "--workdir", work, "--no-progress", "--log-every", "1", "--steps", "3", "--devices", "2",
            "--set", f"model.init_from={path}", "--set", "data.name=tokens", "--set", f"data.path={tmp_path / 'tokens'}",
            "--set", f"model.context={context}", "--set", "model.dropout=0.0", "--set", f"data.batch_size={batch}",
            "--set", "optim.lr=1e-3")
    assert r.returncode == 0, r.stderr
    with open(work / "metrics.jsonl") as f:
        first = [rec for rec in map(json.loads, f) if rec.get("step") == 1 and "loss" in rec][0]["loss"]
    windows = D.load_tokens(tmp_path / "tokens" / "train.bin", context_length=context, vocab_size=VOCAB)
    rows = next(iter(D.make_batches(windows, batch, seed=0)))
    ids = np.concatenate([rows["x"], rows["y"][:, -1:]], axis=1)  # each window's T + 1 tokens
    with torch.no_grad():
        theirs = model(torch.tensor(ids, dtype=torch.long), labels=torch.tensor(ids, dtype=torch.long)).loss.item()
    np.testing.assert_allclose(first, theirs, rtol=2e-6)

    assert f"GPT from '{path}' on tokens" in r.stdout  # the run says what it starts from
    r = cli(capsys, "sample", work, "--prompt", "the model", "--tokens", "4", "--temperature", "0")
    assert r.returncode == 0 and r.stdout.startswith("the model"), r.stderr
    r = cli(capsys, "export", work, tmp_path / "export")
    assert r.returncode == 0, r.stderr
    assert "exported checkpoint 3 of" in r.stdout and "tokenizer.json" in r.stdout
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    trained = load_run(str(work)).model
    np.testing.assert_allclose(hf_logits(back, IDS), np.asarray(trained(IDS, train=False)), rtol=1e-5, atol=1e-6)
    assert np.abs(hf_logits(back, IDS) - hf_logits(model, IDS)).max() > 1e-3  # it trained: not the checkpoint
    r = cli(capsys, "export", work, tmp_path / "export")
    assert r.returncode == 2 and "is a directory that is not empty" in r.stderr and "Traceback" not in r.stderr
