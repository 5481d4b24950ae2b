"""Mixed precision through the trainer: train.precision, parallel.reduce_dtype, model.attention/remat,
train.accelerator_only; bf16 runs reach the float32 runs' held-out results, and a resumed run cannot
change its precision."""
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import jdp.run.cli
import jdp.run.tasks
import jdp.run.facts
from jdp.run.checkpoint import CheckpointMismatchError
from jdp.config import ADDED_DEFAULTS, ATTENTIONS, ConfigError, config_hash, load_config, run_identity
from jdp.models.gpt import ATTENTIONS as GPT_ATTENTIONS
from jdp.train import train

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPT2_SMALL = "configs/gpt2_small.yaml"
# The tolerances the bf16 configs' headers document against their float32 runs.
ACCURACY_TOLERANCE = 0.01  # digits: held-out accuracy within 0.01 of the float32 run
LOSS_TOLERANCE = 0.02  # char gpt: held-out loss within 0.02 of the float32 run
TINY_GPT = ["model.d_model=32", "model.n_heads=2", "model.n_layers=1", "model.context=32", "data.batch_size=32",
            "data.eval_batch_size=512", "model.dropout=0.0"]
FLOAT16_WHY = "(float16 needs loss scaling, which jdp does not implement; bfloat16 has float32's range)"


def exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


def quiet(config, workdir, n=4, **kwargs):
    return train(config, str(workdir), devices=jax.devices()[:n], log=lambda *_: None, progress=False, **kwargs)


# bf16 runs reach the float32 runs' held-out results.
def test_bf16_digits_mlp_reaches_the_float32_accuracy(tmp_path):
    runs = {p: quiet(load_config(None, ["train.steps=120", "train.log_every=120", f"train.precision={p}"]),
                     tmp_path / p) for p in ("fp32", "bf16")}
    fp32, bf16 = runs["fp32"].eval, runs["bf16"].eval
    assert fp32["accuracy"] > 0.9  # enough steps for accuracy to mean something
    assert abs(bf16["accuracy"] - fp32["accuracy"]) <= ACCURACY_TOLERANCE, (bf16, fp32)
    assert bf16["loss"] != fp32["loss"]  # bf16 did compute in bf16
    assert {np.asarray(x).dtype for x in jax.tree.leaves(runs["bf16"].params)} == {np.dtype(np.float32)}  # masters


def test_bf16_char_gpt_gets_the_float32_held_out_loss(tmp_path):
    base = [*TINY_GPT, "train.steps=30", "train.log_every=30", "optim.warmup_steps=5", "model.attention=fused"]
    fp32 = quiet(load_config(str(ROOT / "configs/char_gpt.yaml"), base), tmp_path / "fp32").eval
    bf16 = quiet(load_config(str(ROOT / "configs/char_gpt_bf16.yaml"), [*base, "model.remat=true"]),
                 tmp_path / "bf16").eval
    assert fp32["loss"] < 3.5  # it learned something: a uniform guess over 103 symbols is 4.6
    assert abs(bf16["loss"] - fp32["loss"]) <= LOSS_TOLERANCE, (bf16, fp32)
    assert bf16["loss"] != fp32["loss"]


def test_the_task_builds_models_in_the_compute_dtype(monkeypatch):
    """float32 passes dtype=None (the models' default, so float32 runs are what they were); bfloat16
    passes jnp.bfloat16 to every model, and the gpt gets attention and remat."""
    seen = {}

    def recording(name, cls):
        def build(*args, **kwargs):
            seen[name] = kwargs
            return cls(*args, **kwargs)
        return build

    for name in ("MLP", "CNN", "GPT"):
        monkeypatch.setattr(jdp.run.tasks, name, recording(name, getattr(jdp.run.tasks, name)))
    jdp.run.tasks.build_task(load_config(None, ["model.hidden=[4]"]))
    assert seen["MLP"]["dtype"] is None
    jdp.run.tasks.build_task(load_config(None, ["model.name=cnn", "model.channels=[2,2]", "train.precision=bf16"]))
    assert np.dtype(seen["CNN"]["dtype"]) == np.dtype(jax.numpy.bfloat16)
    jdp.run.tasks.build_task(load_config(None, [*TINY_GPT, "model.name=gpt", "data.name=chars", "train.precision=bf16",
                                            "model.attention=fused", "model.remat=true"]))
    assert (np.dtype(seen["GPT"]["dtype"]), seen["GPT"]["attention"], seen["GPT"]["remat"]) == (
        np.dtype(jax.numpy.bfloat16), "fused", True)


# The shipped configs.
def test_bf16_configs_are_their_float32_runs_in_bf16():
    for name, changed in (("digits_mlp", ["train.precision=bfloat16"]),
                          ("char_gpt", ["train.precision=bfloat16", "parallel.reduce_dtype=bfloat16"])):
        bf16 = load_config(str(ROOT / f"configs/{name}_bf16.yaml"))
        assert bf16 == load_config(str(ROOT / f"configs/{name}.yaml"), changed), name  # nothing else differs
    big = load_config(str(ROOT / GPT2_SMALL))
    m, o = big.model, big.optim
    assert (m.name, m.d_model, m.n_layers, m.n_heads, m.context, m.attention, m.remat) == (
        "gpt", 768, 12, 12, 1024, "auto", "auto")
    assert (o.name, o.schedule, o.warmup_steps > 0, o.clip_norm) == ("adamw", "cosine", True, 1.0)
    assert (big.train.precision, big.train.accelerator_only, big.data.name) == ("bfloat16", True, "chars")


# Config keys: aliases, one-sentence refusals under the dotted key.
def test_new_keys_take_aliases_and_store_full_names():
    cfg = load_config(None, ["train.precision=bf16", "parallel.reduce_dtype=bf16"])
    assert (cfg.train.precision, cfg.parallel.reduce_dtype) == ("bfloat16", "bfloat16")
    assert config_hash(cfg) == config_hash(load_config(None, ["train.precision=bfloat16",
                                                              "parallel.reduce_dtype=bfloat16"]))
    assert load_config(None, ["train.precision=fp32"]).train.precision == "float32"
    defaults = load_config(None)
    assert (defaults.train.precision, defaults.parallel.reduce_dtype, defaults.model.attention, defaults.model.remat,
            defaults.train.accelerator_only) == ("float32", None, "flax", False, False)
    assert ATTENTIONS == GPT_ATTENTIONS
    assert {k: v for k, v in ADDED_DEFAULTS.items()} == {
        "model.attention": "flax", "model.remat": False, "parallel.reduce_dtype": None, "train.precision": "float32",
        "data.dtype": "uint16", "data.vocab_size": None, "model.scan_layers": False, "model.loss_chunk": 0,
        "model.init_from": None}


@pytest.mark.parametrize("override,message", [
    ("train.precision=fp16", f"train.precision: precision='fp16' is not supported {FLOAT16_WHY}; use 'float32' "
                             f"('fp32') or 'bfloat16' ('bf16')."),
    ("train.precision=float16", f"train.precision: precision='float16' is not supported {FLOAT16_WHY}; use "
                                f"'float32' ('fp32') or 'bfloat16' ('bf16')."),
    ("train.precision=int8", "train.precision: precision='int8' is not supported; use 'float32' ('fp32') or "
                             "'bfloat16' ('bf16')."),
    ("train.precision=16", "train.precision must be 'float32' ('fp32') or 'bfloat16' ('bf16'), got 16."),
    ("train.precision=null", "train.precision must be 'float32' ('fp32') or 'bfloat16' ('bf16'), got null."),
    ("parallel.reduce_dtype=fp16", f"parallel.reduce_dtype: reduce_dtype='fp16' is not supported {FLOAT16_WHY}; "
                                   f"use None, 'float32' ('fp32') or 'bfloat16' ('bf16')."),
    ("parallel.reduce_dtype=[bf16]", "parallel.reduce_dtype must be null or 'float32' ('fp32') or 'bfloat16' "
                                     "('bf16'), got ['bf16']."),
    ("model.attention=flash", "model.attention must be one of flax, fused, cudnn, auto, got 'flash'."),
    ("model.remat=1", "model.remat must be true, false or 'auto', got 1."),
    ("train.accelerator_only=maybe", "train.accelerator_only must be true or false, got 'maybe'."),
    ("model.attention=fused", "model.attention='fused' applies to the transformer only and needs "
                              "model.name='gpt', got 'mlp'."),
    ("model.remat=true", "model.remat=true applies to the transformer only and needs model.name='gpt', got 'mlp'."),
    ("model.attention=cudnn", "model.attention='cudnn' applies to the transformer only and needs model.name='gpt', "
                              "got 'mlp'."),
])
def test_bad_values_are_one_sentence_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=exactly(message)):
        load_config(None, [override])


def test_cudnn_attention_needs_bfloat16():
    gpt = ["model.name=gpt", "data.name=chars", "model.attention=cudnn"]
    with pytest.raises(ConfigError, match=exactly("model.attention='cudnn' (cuDNN flash attention) computes in "
                                                  "bfloat16 and needs train.precision='bfloat16', got 'float32'.")):
        load_config(None, gpt)
    assert load_config(None, [*gpt, "train.precision=bf16"]).model.attention == "cudnn"


# train.accelerator_only.
def run_jdp(*args):
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    return subprocess.run([sys.executable, "-m", "jdp.run.cli", "train", *args], capture_output=True, text=True,
                          timeout=300, cwd=str(ROOT), env=env)


def test_an_accelerator_config_is_refused_on_cpus_in_one_sentence(tmp_path):
    r = run_jdp(GPT2_SMALL, "--workdir", str(tmp_path / "w"), "--no-progress")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr == (f"jdp: error: {GPT2_SMALL} is meant for accelerators (GPU/TPU) and jax sees only CPUs here; "
                        f"pass --stop-after N (or --steps N) to run N steps on the CPU anyway.\n")
    assert not (tmp_path / "w").exists()  # refused before anything is written


def test_stop_after_runs_an_accelerator_config_on_cpus(tmp_path):
    tiny = [arg for key in TINY_GPT for arg in ("--set", key)]
    r = run_jdp(GPT2_SMALL, "--stop-after", "1", *tiny, "--devices", "2", "--workdir", str(tmp_path / "w"),
                "--no-progress")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if "accelerator_only" in line]
    assert lines == ["train.accelerator_only=true but the 2 device(s) are CPUs: training on them anyway, as asked "
                     "(allow_cpu)."]
    assert "stopped at step 1 of 300" in r.stdout


def test_steps_or_stop_after_is_the_cli_opt_in():
    """--steps and --stop-after each let an accelerator config train on CPUs; neither refuses it."""
    cfg, cpus = load_config(str(ROOT / GPT2_SMALL)), jax.devices()[:1]
    parse = jdp.run.cli.build_parser().parse_args
    assert jdp.run.cli._cpu_asked_for(parse(["train", GPT2_SMALL, "--steps", "2"]), cfg, cpus)
    assert jdp.run.cli._cpu_asked_for(parse(["train", GPT2_SMALL, "--stop-after", "2"]), cfg, cpus)
    with pytest.raises(ValueError, match="is meant for accelerators"):
        jdp.run.cli._cpu_asked_for(parse(["train", GPT2_SMALL]), cfg, cpus)
    assert not jdp.run.cli._cpu_asked_for(parse(["train"]), load_config(None), cpus)  # other configs: no question


def test_train_refuses_an_accelerator_config_on_cpus_unless_allowed(tmp_path):
    cfg = load_config(None, ["train.accelerator_only=true", "train.steps=1", "model.hidden=[4]"])
    with pytest.raises(ValueError, match=exactly(
            "the config is meant for accelerators (train.accelerator_only=true) and the devices are CPUs; pass "
            "allow_cpu=True to train on them anyway.")):
        quiet(cfg, tmp_path / "w")
    assert not (tmp_path / "w").exists()
    logged = []
    result = train(cfg, str(tmp_path / "w"), devices=jax.devices()[:2], log=logged.append, progress=False,
                   allow_cpu=True)
    assert result.steps == 1 and any("training on them anyway" in line for line in logged)
    # Where a run may start is not what it trains: the same run resumes with accelerator_only off.
    assert "accelerator_only" not in run_identity(cfg)["train"]
    assert quiet(load_config(None, ["train.steps=1", "model.hidden=[4]"]), tmp_path / "w", 2).resumed_from == 1


# Resuming with another precision.
def test_resume_with_another_precision_is_refused_and_the_checkpoint_kept(tmp_path):
    tiny = ["train.steps=2", "model.hidden=[4]", "data.batch_size=32"]
    assert quiet(load_config(None, tiny), tmp_path, 2).steps == 2
    for changed, diff in (("train.precision=bf16", "train.precision: checkpoint 'float32', now 'bfloat16'"),
                          ("parallel.reduce_dtype=bf16", "parallel.reduce_dtype: checkpoint None, now 'bfloat16'")):
        refusal = f"was written by a different run ({diff}); use another --workdir or the original configuration."
        with pytest.raises(CheckpointMismatchError, match=re.escape(refusal)):
            quiet(load_config(None, [*tiny, changed]), tmp_path, 2)
    assert quiet(load_config(None, [*tiny, "train.precision=fp32"]), tmp_path, 2).resumed_from == 2  # same run


def test_a_checkpoint_from_before_precision_resumes_only_in_float32(tmp_path, monkeypatch):
    """Checkpoints older than train.precision (and the other ADDED_DEFAULTS) lack those keys: they were
    trained with the defaults, so they resume with them and refuse anything else."""
    tiny = ["train.steps=2", "model.hidden=[4]", "data.batch_size=32", "train.checkpoint_every=1"]

    def older(config):
        identity = run_identity(config)
        for dotted in ADDED_DEFAULTS:
            section, key = dotted.split(".")
            del identity[section][key]
        return identity

    with monkeypatch.context() as old_jdp:
        old_jdp.setattr(jdp.run.facts, "run_identity", older)
        quiet(load_config(None, tiny), tmp_path, 2, stop_after=1)
    with pytest.raises(CheckpointMismatchError, match=re.escape("train.precision: checkpoint '<absent>', now "
                                                                "'bfloat16'")):
        quiet(load_config(None, [*tiny, "train.precision=bf16"]), tmp_path, 2)
    assert quiet(load_config(None, tiny), tmp_path, 2).resumed_from == 1
