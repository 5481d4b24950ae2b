"""Llama-family checkpoints in (`jdp.models.from_hf`) and out (`jdp.models.save_hf`), against transformers'
own LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM (tests/llama_checkpoints.py builds them)."""
import json
import os
import shutil
import tracemalloc

import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx

from jdp.models import Llama, LlamaArchitecture, from_hf, save_hf
from jdp.models.hub.folder import checkpoint_tensors
from jdp.models.hub.llama_in import llama_params, read_llama_architecture
from jdp.models.hub.safetensors_io import load as load_safetensors
from llama_checkpoints import IDS, KINDS, POSITIONS, VOCAB, hf_logits, hf_model

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """{kind: (folder, transformers model)}, plus a sharded float32 and a bfloat16 copy of the untied Llama."""
    root = tmp_path_factory.mktemp("llama")
    out = {}
    for kind in KINDS:
        model = hf_model(kind)
        model.save_pretrained(root / kind)
        out[kind] = (str(root / kind), model)
    model = out["llama_untied_llama3"][1]
    model.save_pretrained(root / "sharded", max_shard_size="40KB")
    bf16 = hf_model("llama_untied_llama3").to(torch.bfloat16)
    bf16.save_pretrained(root / "bf16")
    out["sharded"], out["bf16"] = (str(root / "sharded"), model), (str(root / "bf16"), bf16)
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_transformers_checkpoint_loads_with_its_logits_and_first_loss(hf, kind):
    path, model = hf[kind]
    ours = from_hf(path)
    assert isinstance(ours, Llama) and ours.tie_embeddings == model.config.tie_word_embeddings
    logits = np.asarray(ours(IDS, train=False))
    np.testing.assert_allclose(logits, hf_logits(model, IDS), **TOL)
    with torch.no_grad():  # transformers' loss: labels = the inputs, shifted inside
        theirs = float(model(torch.tensor(IDS), labels=torch.tensor(IDS)).loss)
    ours_loss = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], IDS[:, 1:]).mean()
    np.testing.assert_allclose(float(ours_loss), theirs, rtol=1e-6)


def test_every_attention_scanned_and_rematerialised_is_the_same_function(hf):
    path, model = hf["llama_untied_llama3"]
    ref = hf_logits(model, IDS)
    for options in (dict(attention="fused"), dict(scan_layers=True, remat=True), dict(attention="fused", scan_layers=True)):
        np.testing.assert_allclose(np.asarray(from_hf(path, **options)(IDS, train=False)), ref, **TOL, err_msg=str(options))


def test_a_sharded_and_a_bfloat16_checkpoint_load(hf):
    sharded, model = hf["sharded"]
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    np.testing.assert_allclose(np.asarray(from_hf(sharded)(IDS, train=False)), hf_logits(model, IDS), **TOL)
    path, bf16 = hf["bf16"]
    ours = from_hf(path)
    assert ours.weights_dtype == "bfloat16"
    float32_copy = hf_model("llama_untied_llama3").float()
    float32_copy.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
    np.testing.assert_allclose(np.asarray(ours(IDS, train=False)), hf_logits(float32_copy, IDS), **TOL)


@pytest.mark.parametrize("kind", ["llama_tied_gqa", "bf16", "qwen2"])
def test_save_hf_gives_back_every_tensor_bit_for_bit_and_transformers_loads_it(hf, kind, tmp_path):
    path, _ = hf[kind]
    ours = from_hf(path, scan_layers=kind == "qwen2")  # a scanned model's stacked layers are cut apart
    out = save_hf(ours, tmp_path / "export")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    original, written = load_safetensors(os.path.join(path, "model.safetensors")), load_safetensors(
        os.path.join(out, "model.safetensors"))
    assert sorted(original) == sorted(written)
    for name in original:
        assert original[name].dtype == written[name].dtype and original[name].tobytes() == written[name].tobytes(), name
    with open(os.path.join(path, "config.json")) as f:
        before = json.load(f)
    with open(os.path.join(out, "config.json")) as f:
        after = json.load(f)
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
            "tie_word_embeddings", "attention_bias", "sliding_window", "use_sliding_window", "hidden_act")
    assert {k: after.get(k) for k in keys if k in before} == {k: before[k] for k in keys if k in before}
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()  # bf16 weights, f32 compute
    np.testing.assert_allclose(hf_logits(back, IDS), np.asarray(ours(IDS, train=False)), **TOL)


def copy_with(hf, tmp_path, name, kind="llama_untied_llama3", **changes):
    target = tmp_path / name
    shutil.copytree(hf[kind][0], target)
    with open(target / "config.json") as f:
        config = json.load(f)
    config.update(changes)
    with open(target / "config.json", "w") as f:
        json.dump(config, f)
    return target


def test_what_jdps_llama_cannot_compute_is_refused_naming_the_key(hf, tmp_path):
    rope = lambda kind: {"rope_parameters": {"rope_type": kind, "rope_theta": 1e4, "factor": 2.0}}  # noqa: E731
    cases = [(copy_with(hf, tmp_path, "gemma", model_type="gemma"), "model_type 'gemma'; jdp reads 'gpt2'"),
             (copy_with(hf, tmp_path, "yarn", **rope("yarn")), "rope_parameters of rope_type 'yarn'"),
             (copy_with(hf, tmp_path, "dynamic", **rope("dynamic")), "rope_type 'dynamic'"),
             (copy_with(hf, tmp_path, "longrope", **rope("longrope")), "rope_type 'longrope'"),
             (copy_with(hf, tmp_path, "legacy_yarn", rope_parameters=None, rope_scaling={"type": "yarn", "factor": 2.0}),
              "rope_scaling of rope_type 'yarn'"),
             (copy_with(hf, tmp_path, "mlp_bias", mlp_bias=True), "mlp_bias=True; jdp's Llama computes only mlp_bias=False"),
             (copy_with(hf, tmp_path, "gelu", hidden_act="gelu"), "hidden_act='gelu'"),
             (copy_with(hf, tmp_path, "window", "mistral", sliding_window=16),
              f"sliding_window=16, fewer than the {POSITIONS} positions"),
             (copy_with(hf, tmp_path, "window_short_by_one", "mistral", sliding_window=POSITIONS - 1),
              f"sliding_window={POSITIONS - 1}, fewer than the {POSITIONS} positions"),
             (copy_with(hf, tmp_path, "heads", num_key_value_heads=3), "n_heads=4 must be a multiple of n_kv_heads=3")]
    pickled = copy_with(hf, tmp_path, "bin")
    os.rename(pickled / "model.safetensors", pickled / "pytorch_model.bin")
    cases.append((pickled, "holds its weights as pytorch_model.bin.*LlamaForCausalLM.from_pretrained"))
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            from_hf(path)
    assert from_hf(copy_with(hf, tmp_path, "window_ok", "mistral", sliding_window=16), context=16).context == 16
    # A window of exactly the context covers every earlier position (transformers: i - j < window).
    assert from_hf(copy_with(hf, tmp_path, "window_whole", "mistral", sliding_window=POSITIONS)).context == POSITIONS


def test_an_older_config_json_with_top_level_rope_theta_and_rope_scaling_loads_the_same(hf, tmp_path):
    """transformers before 5 wrote rope_theta and rope_scaling at the top level (no rope_parameters)."""
    path, model = hf["llama_untied_llama3"]
    with open(os.path.join(path, "config.json")) as f:
        rope = json.load(f).get("rope_parameters") or {}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    older = copy_with(hf, tmp_path, "older", rope_parameters=None, rope_theta=500000.0, rope_scaling=scaling)
    np.testing.assert_allclose(np.asarray(from_hf(older)(IDS, train=False)), hf_logits(model, IDS), **TOL)


def test_a_missing_unknown_or_untied_head_tensor_is_named(hf):
    path, _ = hf["llama_tied_gqa"]
    arch = read_llama_architecture(path)
    tensors = dict(checkpoint_tensors(path))
    embedding = tensors["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        llama_params([*tensors.items(), ("lm_head.weight", embedding + 1)], arch, "x")
    llama_params([*tensors.items(), ("lm_head.weight", embedding)], arch, "x")  # an equal copy is a tie
    with pytest.raises(ValueError, match="'model.layers.2.mlp.up_proj.weight', which a llama of config.json's 2 layers"):
        llama_params([*tensors.items(), ("model.layers.2.mlp.up_proj.weight", embedding)], arch, "x")
    untied = read_llama_architecture(hf["mistral"][0])
    with pytest.raises(ValueError, match="lack 'lm_head.weight', which config.json's tie_word_embeddings=false needs"):
        llama_params([(k, v) for k, v in checkpoint_tensors(hf["mistral"][0]) if k != "lm_head.weight"], untied, "x")


def test_the_weights_are_read_without_a_second_copy(hf):
    """Reading converts one tensor at a time: numpy's peak is the params made plus about one tensor."""
    path, _ = hf["bf16"]  # bfloat16 → float32: each tensor's one conversion is the copy kept
    arch = read_llama_architecture(path)
    tracemalloc.start()
    params, _ = llama_params(checkpoint_tensors(path), arch, "x")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    sizes = [a.nbytes for a in (v for _, v in _leaves(params))]
    assert peak < sum(sizes) + 2 * max(sizes), (peak, sum(sizes), max(sizes))


def _leaves(tree, prefix=()):
    for key, value in tree.items():
        yield from (_leaves(value, prefix + (key,)) if isinstance(value, dict) else [(prefix + (key,), value)])


def test_the_architecture_and_model_refuse_bad_values_in_one_sentence():
    good = dict(vocab_size=VOCAB, context=POSITIONS, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, d_ff=64)
    for change, message in ((dict(n_kv_heads=3), "multiple of n_kv_heads=3"), (dict(head_dim=7), "head_dim=7 must be even"),
                            (dict(d_ff=0), "d_ff=0 must be positive"), (dict(rms_norm_eps=0.0), "rms_norm_eps=0.0")):
        with pytest.raises(ValueError, match=message):
            LlamaArchitecture(**{**good, **change})
    arch = LlamaArchitecture(**good, sliding_window=16)
    with pytest.raises(ValueError, match="sliding_window=16 is smaller than the 32 positions"):
        Llama(arch, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="attention='xla' is not one of"):
        Llama(arch, attention="xla", context=16, rngs=nnx.Rngs(0))
    model = Llama(arch, context=16, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="sequence length 17 exceeds the model's context of 16"):
        model(np.zeros((1, 17), np.int32))
