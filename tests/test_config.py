"""jdp.config: shipped configs, defaults, overrides, one-sentence errors, schedules, hashing."""
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import jdp
from jdp.config import (HASH_EXCLUDED, SECTIONS, Config, ConfigError, DataConfig, ModelConfig, OptimConfig,
                        apply_overrides, config_from_dict, config_hash, field_docs, load_config, run_identity,
                        validate)
from jdp.data import load_seed_regression
from jdp.run.config import steps_override
from jdp.core.optim import for_reduction

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(glob.glob(os.path.join(ROOT, "jdp", "configs", "*.yaml")))


def exactly(message: str) -> str:
    return "^" + re.escape(message) + "$"


def write(tmp_path, text: str, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# Shipped configs.
def test_every_expected_config_is_shipped():
    names = {os.path.basename(p) for p in SHIPPED}
    assert names >= {"digits_mlp.yaml", "digits_cnn_syncbn.yaml", "char_gpt.yaml", "seed_linear.yaml",
                     "digits_mlp_accum_psum.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_shipped_config_loads_validates_and_has_its_header(path, tmp_path, monkeypatch):
    with open(path) as f:
        text = f.read()
    if "name: tokens" in text:  # its token files are written by the command its header names first
        monkeypatch.chdir(tmp_path)
        subprocess.run([sys.executable, "-m", "jdp.run.cli", "data", "prepare-tokens", "python-reference",
                        "runs/pyref_tokens"], check=True, capture_output=True, timeout=120)
    if "path: runs/stdlib_bpe " in text:  # a folder with meta.json: a small BPE of it here (the header's takes minutes)
        from jdp.data.prepare import prepare

        (tmp_path / "small.py").write_text("def f(x):\n    return x + 1\n" * 200)
        prepare("small.py", "runs/stdlib_bpe", tokenizer="bpe:300")
    cfg = load_config(path)
    assert validate(cfg, cfg.parallel.devices or 4) is cfg
    validate(cfg, 8)  # the test suite's device count, too
    with open(path) as f:
        lines = f.read().splitlines()
    header = lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))]
    name = os.path.splitext(os.path.basename(path))[0]
    assert len(header) >= 3, "a header says what it trains, the command and the expected result"
    assert f"# Run: jdp train {name} --workdir runs/{name}" in header
    assert sum(line.startswith("# Expected result: ") for line in header) == 1


def test_shipped_configs_say_what_they_were_asked_to():
    gpt = load_config(os.path.join(ROOT, "configs", "char_gpt.yaml"))
    assert (gpt.model.name, gpt.data.name, gpt.optim.name, gpt.optim.schedule) == ("gpt", "chars", "adamw", "cosine")
    assert gpt.optim.warmup_steps > 0
    cnn = load_config(os.path.join(ROOT, "configs", "digits_cnn_syncbn.yaml"))
    assert (cnn.model.name, cnn.model.sync_batchnorm, cnn.data.name) == ("cnn", True, "digits")
    acc = load_config(os.path.join(ROOT, "configs", "digits_mlp_accum_psum.yaml")).parallel
    assert (acc.accum_steps, acc.accum_sync, acc.reduction, acc.lr_correction) == (4, "last", "sum", "exact")


def _linear_step(cfg, n):
    """The config's step for y = x·w (MSE) on `n` devices, as `jdp train` builds it."""
    p = cfg.parallel
    return jdp.make_train_step(lambda w, b: ((b["x"] @ w["w"] - b["t"]) ** 2).mean(), cfg.optimizer_spec(),
                               backend=p.backend, reduction=p.reduction, lr_correction=p.lr_correction,
                               devices=jax.devices()[:n], accum_steps=p.accum_steps, accum_sync=p.accum_sync)


def test_seed_linear_config_reproduces_the_seed_step():
    """Seed regression 2 through the config: w = (0.5, -0.3), 4 devices, mean, SGD 0.1 -> w = (0.915, 0.085)."""
    cfg = load_config(os.path.join(ROOT, "configs", "seed_linear.yaml"))
    validate(cfg, 8)
    step = _linear_step(cfg, cfg.parallel.devices)
    data = load_seed_regression(cfg.data.seed_example)
    state = step.init({"w": np.array([0.5, -0.3], np.float32)}, seed=cfg.train.seed)
    state, metrics = step(state, data.take(np.arange(cfg.data.batch_size)))
    np.testing.assert_allclose(jdp.get_params(state)["w"], [0.915, 0.085], atol=1e-6)
    assert cfg.optimizer_spec().learning_rate(0) == 0.1


# Defaults, fields, round trips.
def test_defaults_are_the_default_run():
    cfg = load_config(None)
    assert cfg == Config()
    assert (cfg.model.name, cfg.model.hidden, cfg.data.name, cfg.data.batch_size) == ("mlp", (128,), "digits", 128)
    assert (cfg.parallel.backend, cfg.parallel.reduction, cfg.parallel.devices) == ("shard_map", "mean", None)
    assert (cfg.train.steps, cfg.train.eval_every, cfg.train.checkpoint_every) == (300, 0, 0)
    assert cfg.optimizer_spec() == jdp.OptimizerSpec("adam", lr=3e-3)


def test_every_field_has_a_docstring():
    for cls in (*SECTIONS.values(), Config):
        names = [f.name for f in dataclasses.fields(cls)]
        docs = field_docs(cls)
        assert sorted(docs) == sorted(names), cls.__name__
        assert all(docs.values())


def test_to_dict_is_json_and_round_trips(tmp_path):
    cfg = load_config(None, ["model.hidden=[256, 128]", "optim.clip_norm=1.0", "data.path=null"])
    d = cfg.to_dict()
    assert d["model"]["hidden"] == [256, 128]
    assert json.loads(json.dumps(d)) == d
    assert config_from_dict(d) == cfg
    assert load_config(write(tmp_path, json.dumps(d))) == cfg  # JSON is YAML


def test_empty_file_and_empty_sections_are_defaults(tmp_path):
    assert load_config(write(tmp_path, "# only a comment\n")) == Config()
    assert load_config(write(tmp_path, "optim:\nmodel: {}\n")) == Config()


def test_sections_check_values_when_built_in_code():
    with pytest.raises(ConfigError, match=exactly("optim.lr must be a positive number, got 0.")):
        dataclasses.replace(Config().optim, lr=0)
    with pytest.raises(ConfigError, match=exactly("Config.optim must be of type OptimConfig, got dict.")):
        Config(optim={})
    assert ModelConfig(hidden=[3, 4]).hidden == (3, 4)
    assert OptimConfig(lr=1).lr == 1.0 and isinstance(OptimConfig(lr=1).lr, float)


# Overrides.
def test_overrides_of_each_type(tmp_path):
    cfg = load_config(None, ["optim.lr=3e-4", "data.batch_size=512", "model.hidden=[256,128]",
                             "data.drop_last=false", "optim.clip_norm=0.5", "optim.clip_norm=null",
                             "parallel.backend=pmap", "optim.momentum=0", "parallel.devices=4",
                             "train.steps=10"])
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)  # YAML 1.1 reads 3e-4 as a string
    assert cfg.data.batch_size == 512 and type(cfg.data.batch_size) is int
    assert cfg.model.hidden == (256, 128)
    assert cfg.data.drop_last is False
    assert cfg.optim.clip_norm is None  # the later override wins
    assert cfg.parallel.backend == "pmap"
    assert cfg.optim.momentum == 0.0 and isinstance(cfg.optim.momentum, float)
    assert (cfg.parallel.devices, cfg.train.steps) == (4, 10)


def test_overrides_apply_on_top_of_a_file(tmp_path):
    path = write(tmp_path, "optim:\n  name: sgd\n  lr: 1e-2\ntrain:\n  steps: 5\n")
    cfg = load_config(path, ["optim.lr=0.5", "model.hidden=[]"])
    assert (cfg.optim.name, cfg.optim.lr, cfg.train.steps, cfg.model.hidden) == ("sgd", 0.5, 5, ())
    assert load_config(path).optim.lr == 0.01  # an exponent without a dot in the file, too
    assert load_config(path, None) == load_config(path)
    assert apply_overrides(cfg, ["train.steps=7"]).train.steps == 7


# Bad values: one sentence each, naming the key and what it accepts.
BAD_OVERRIDES = [
    (["optim.lrr=1"], "unknown key 'optim.lrr'; optim has: name, lr, momentum, b1, b2, eps, weight_decay, "
                      "clip_norm, schedule, warmup_steps, linear_scaling, base_batch_size."),
    (["optimizer.lr=1"], "unknown key 'optimizer.lr'; a config has: model, data, optim, parallel, train."),
    (["optim.lr=-1"], "optim.lr must be a positive number, got -1."),
    (["optim.lr=abc"], "optim.lr must be a positive number, got 'abc'."),
    (["optim.lr=.nan"], "optim.lr must be a positive number, got nan."),
    (["optim.lr=null"], "optim.lr must be a positive number, got null."),
    (["parallel.backend=tpu"], "parallel.backend must be one of shard_map, pmap, jit, got 'tpu'."),
    (["model.name=resnet"], "model.name must be one of mlp, cnn, gpt, linear, got 'resnet'."),
    (["data.batch_size=1.5"], "data.batch_size must be a positive integer, got 1.5."),
    (["data.batch_size=true"], "data.batch_size must be a positive integer, got true."),
    (["data.batch_size=0"], "data.batch_size must be a positive integer, got 0."),
    (["model.hidden=[256, x]"], "model.hidden must be a list of positive integers, got [256, 'x']."),
    (["model.hidden=256"], "model.hidden must be a list of positive integers, got 256."),
    (["model.channels=[16]"], "model.channels must be a list of two positive integers, got [16]."),
    (["model.sync_batchnorm=1"], "model.sync_batchnorm must be true or false, got 1."),
    (["model.dropout=1.0"], "model.dropout must be a number in [0, 1), got 1.0."),
    (["optim.clip_norm=0"], "optim.clip_norm must be null or a positive number, got 0."),
    (["parallel.lr_correction=half"],
     "parallel.lr_correction must be null or one of auto, none, exact, got 'half'."),
    (["parallel.devices=0"], "parallel.devices must be null or a positive integer, got 0."),
    (["data.test_fraction=0"], "data.test_fraction must be a number strictly between 0 and 1, got 0."),
    (["data.seed_example=3"], "data.seed_example must be 1 or 2, got 3."),
    (["data.name=arrays", "model.name=linear", "data.path=x.csv"],
     "data.path must be the path of a .npz file with data.name='arrays', got 'x.csv'."),
    (["train.eval_every=-1"], "train.eval_every must be an integer of at least 0, got -1."),
    (["optim.schedule=step"], "optim.schedule must be one of constant, cosine, linear, got 'step'."),
    (["optim.lr"], "override 'optim.lr' has no '='; write section.key=value, e.g. optim.lr=3e-4."),
    (["lr=1"], "override 'lr=1' must name one key as section.key, e.g. optim.lr=3e-4."),
    (["optim.lr="], "override 'optim.lr=' has no value; write optim.lr=null for none."),
    (["model.hidden=[1,"], "override 'model.hidden=[1,' has a value that is not valid YAML: '[1,'."),
    # Impossible combinations, caught at load time (no device count needed).
    (["data.name=chars"], "model.name='mlp' cannot train on data.name='chars'; mlp takes data.name digits or arrays."),
    (["model.name=cnn", "data.name=chars"],
     "model.name='cnn' cannot train on data.name='chars'; cnn takes data.name digits or arrays."),
    (["model.name=gpt"], "model.name='gpt' cannot train on data.name='digits'; gpt takes data.name chars or tokens."),
    (["model.name=linear"],
     "model.name='linear' cannot train on data.name='digits'; linear takes data.name seed_linear or arrays."),
    (["model.name=linear", "data.name=arrays"],
     "data.name='arrays' needs data.path, a .npz file with arrays 'x' and 'y'."),
    (["data.path=x.npz"], "data.path is read only with data.name 'arrays' or 'tokens', got data.name='digits'."),
    (["model.sync_batchnorm=true"], "model.sync_batchnorm=true needs model.name='cnn' (the model with BatchNorm), "
                                    "got 'mlp'."),
    (["model.name=gpt", "data.name=chars", "model.d_model=60", "model.n_heads=8"],
     "model.d_model=60 is not divisible by model.n_heads=8."),
    # The optimizer's and the step's own rules (jdp.OptimizerSpec, jdp.core.options.StepOptions), under the key.
    (["optim.schedule=cosine", "optim.warmup_steps=300"],
     "optim.warmup_steps: warmup_steps=300 must be less than decay_steps=300, since schedule='cosine' decays to 0 "
     "at decay_steps."),
    (["optim.schedule=linear", "optim.warmup_steps=20", "train.steps=10"],
     "optim.warmup_steps: warmup_steps=20 must be less than decay_steps=10, since schedule='linear' decays to 0 "
     "at decay_steps."),
    (["optim.weight_decay=0.1"],
     "optim.weight_decay: weight_decay=0.1 needs name='adamw' (decoupled decay); got name='adam'."),
    (["parallel.lr_correction=exact"],
     "parallel.lr_correction: lr_correction='exact' only applies to reduction='sum'; the mean reduction already "
     "yields the global-batch gradient (use None or 'none')."),
    (["data.batch_size=2048"], "data.batch_size=2048 is more than the 1438 digits training examples, so with "
                               "data.drop_last=true no batch is ever full."),
    (["model.name=linear", "data.name=seed_linear", "data.seed_example=1", "data.batch_size=8"],
     "data.batch_size=8 is more than the 4 examples of data.seed_example=1, so with data.drop_last=true no batch "
     "is ever full."),
    (["parallel.devices=3"], "data.batch_size=128 is not a multiple of parallel.accum_steps × devices = 1 × 3; "
                             "use a multiple of 3."),
]


@pytest.mark.parametrize("overrides,message", BAD_OVERRIDES, ids=[" ".join(o) for o, _ in BAD_OVERRIDES])
def test_bad_override_says_one_sentence(overrides, message):
    with pytest.raises(ConfigError, match=exactly(message)):
        load_config(None, overrides)


def test_good_combinations_near_the_bad_ones(tmp_path):
    load_config(None, ["parallel.lr_correction=none"])  # "none" is fine with mean
    load_config(None, ["model.name=cnn", "parallel.accum_sync=last"])  # no accumulation: nothing to skip
    load_config(None, ["optim.warmup_steps=500"])  # a constant schedule does not decay
    load_config(None, ["data.batch_size=2048", "data.drop_last=false"])
    np.savez(tmp_path / "d.npz", x=np.zeros((4, 2)), y=np.zeros(4))
    cfg = load_config(None, ["model.name=linear", "data.name=arrays", f"data.path={tmp_path / 'd.npz'}"])
    assert cfg.data.path.endswith("d.npz")


def test_missing_arrays_file(tmp_path):
    missing = str(tmp_path / "nope.npz")
    with pytest.raises(ConfigError, match=exactly(f"data.path={missing!r} is not a file (relative paths start at "
                                                  f"{os.getcwd()}).")):
        load_config(None, ["model.name=linear", "data.name=arrays", f"data.path={missing}"])


def test_validate_with_the_device_count():
    cfg = load_config(None, ["data.batch_size=130"])  # no device count yet: loads
    with pytest.raises(ConfigError, match=exactly("data.batch_size=130 is not a multiple of parallel.accum_steps × "
                                                  "devices = 1 × 4; use a multiple of 4.")):
        validate(cfg, 4)
    validate(load_config(None, ["data.batch_size=130"]), 2)
    acc = load_config(None, ["parallel.accum_steps=4", "data.batch_size=120"])
    with pytest.raises(ConfigError, match=exactly("data.batch_size=120 is not a multiple of parallel.accum_steps × "
                                                  "devices = 4 × 4; use a multiple of 16.")):
        validate(acc, 4)
    with pytest.raises(ConfigError, match=exactly("parallel.devices=8 is more than the 4 devices available.")):
        validate(load_config(None, ["parallel.devices=8"]), 4)
    validate(load_config(None, ["parallel.devices=2", "data.batch_size=130"]), 4)  # uses 2 of the 4
    with pytest.raises(ValueError, match=exactly("num_devices=0 must be a positive integer, or None.")):
        validate(Config(), 0)


def test_validate_catches_combinations_built_in_code():
    cfg = dataclasses.replace(Config(), data=DataConfig(name="chars"))
    with pytest.raises(ConfigError, match="cannot train on data.name='chars'"):
        validate(cfg, 4)


BAD_FILES = [
    ("- 1\n- 2\n", "{path} must hold a mapping of sections (model, data, optim, parallel, train), got list."),
    ("optim:\n  lr: 0.1\n   name: sgd\n", "{path}: invalid YAML at line 3, column 8: mapping values are not "
                                           "allowed here."),
    ("optim: [1, 2\n", "{path}: invalid YAML at line 2, column 1: expected ',' or ']', but got '<stream end>'."),
    ("optim: 3\n", "optim must be a mapping of its keys (name, lr, momentum, b1, b2, eps, weight_decay, clip_norm, "
                   "schedule, warmup_steps, linear_scaling, base_batch_size), got int."),
    ("optimizer:\n  lr: 1\n", "unknown key 'optimizer'; a config has: model, data, optim, parallel, train."),
    ("train:\n  stepz: 3\n", "unknown key 'train.stepz'; train has: steps, log_every, eval_every, "
                             "checkpoint_every, keep_checkpoints, max_nonfinite, seed, precision, accelerator_only, profile_steps."),
]


@pytest.mark.parametrize("text,message", BAD_FILES)
def test_bad_file_says_one_sentence(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=exactly(message.format(path=path))):
        load_config(path)


def test_missing_file_and_directory(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=exactly(f"config file {missing!r} does not exist.")):
        load_config(missing)
    with pytest.raises(ConfigError, match=exactly(f"config file {str(tmp_path)!r} is not a file.")):
        load_config(str(tmp_path))


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# Learning rate: linear scaling, schedules, the built chain.
def test_linear_scaling_is_opt_in():
    cfg = load_config(None, ["optim.lr=0.1", "data.batch_size=1024"])
    assert cfg.optimizer_spec().lr == 0.1
    scaled = apply_overrides(cfg, ["optim.linear_scaling=true"])
    assert scaled.optimizer_spec().lr == pytest.approx(0.4)  # the linear scaling rule: 0.1 × 1024 / 256
    assert scaled.optimizer_spec().learning_rate(0) == pytest.approx(0.4)
    assert apply_overrides(scaled, ["optim.base_batch_size=512"]).optimizer_spec().lr == pytest.approx(0.2)


def test_warmup_then_cosine():
    cfg = load_config(None, ["optim.lr=0.2", "optim.schedule=cosine", "optim.warmup_steps=10", "train.steps=110"])
    lr_at = cfg.optimizer_spec().learning_rate
    expected = {0: 0.0, 5: 0.1, 10: 0.2, 35: 0.1 * (1 + np.cos(np.pi / 4)), 60: 0.1, 110: 0.0, 200: 0.0}
    for step, lr in expected.items():
        assert lr_at(step) == pytest.approx(lr, abs=1e-6), step


def test_warmup_then_linear_and_constant():
    base = ["optim.lr=0.2", "optim.warmup_steps=10", "train.steps=110"]
    linear = load_config(None, [*base, "optim.schedule=linear"]).optimizer_spec().learning_rate
    constant = load_config(None, [*base, "optim.schedule=constant"]).optimizer_spec().learning_rate
    for step, lr in {0: 0.0, 5: 0.1, 10: 0.2, 60: 0.1, 110: 0.0}.items():
        assert linear(step) == pytest.approx(lr, abs=1e-6), step
    for step, lr in {0: 0.0, 5: 0.1, 10: 0.2, 60: 0.2, 500: 0.2}.items():
        assert constant(step) == pytest.approx(lr, abs=1e-6), step


def _run(tx, grads_per_step, params):
    state = tx.init(params)
    for g in grads_per_step:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_the_chain_applies_the_schedule_per_optimizer_step():
    cfg = load_config(None, ["optim.name=sgd", "optim.lr=0.2", "optim.schedule=linear", "optim.warmup_steps=2",
                             "train.steps=6", "optim.clip_norm=100"])
    spec = cfg.optimizer_spec()
    tx, lr_at = spec.build(), spec.learning_rate
    p0 = {"w": np.zeros(2, np.float32)}
    g = {"w": np.ones(2, np.float32)}
    got = _run(tx, [g] * 4, p0)["w"]
    np.testing.assert_allclose(got, -sum(lr_at(k) for k in range(4)) * np.ones(2), rtol=1e-6)
    assert [lr_at(k) for k in range(4)] == pytest.approx([0.0, 0.1, 0.2, 0.15])
    clipped = _run(apply_overrides(cfg, ["optim.clip_norm=0.5"]).optimizer_spec().build(), [g] * 4, p0)["w"]
    np.testing.assert_allclose(clipped, got * 0.5 / np.sqrt(2), rtol=1e-6)  # clipping comes first


def test_constant_schedule_gives_optax_the_float_lr():
    """No schedule, no warmup: the chain is optax's own with the float lr, bit for bit."""
    cfg = load_config(None, ["optim.name=adamw", "optim.weight_decay=0.1", "optim.clip_norm=1.0"])
    spec = cfg.optimizer_spec()
    assert (spec.schedule, spec.decay_steps, spec.lr_schedule()) == ("constant", None, 3e-3)
    p0 = {"w": np.array([1.0, -2.0], np.float32)}
    grads = [{"w": np.array([3.0, 0.5], np.float32)}, {"w": np.array([-1.0, 2.0], np.float32)}]
    by_hand = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.1))
    np.testing.assert_array_equal(_run(spec.build(), grads, p0)["w"], _run(by_hand, grads, p0)["w"])
    assert spec.learning_rate(0) == spec.learning_rate(1000) == 3e-3


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_exact_correction_keeps_the_schedule(name):
    """psum (N× the mean) through the exact chain = the mean through the plain chain, schedule included."""
    over = [f"optim.name={name}", "optim.schedule=cosine", "optim.warmup_steps=2", "train.steps=8",
            "optim.clip_norm=1.0"]
    mean = load_config(None, over).optimizer_spec()
    summed = load_config(None, [*over, "parallel.reduction=sum", "parallel.lr_correction=exact"]).optimizer_spec()
    assert summed == mean  # the correction is the step's, not the spec's
    p0 = {"w": np.array([1.0, -2.0], np.float32)}
    grads = [{"w": np.array([0.3 * k, -0.2], np.float32)} for k in range(1, 6)]
    np.testing.assert_allclose(_run(for_reduction(summed, "exact", 4), [{"w": 4 * g["w"]} for g in grads], p0)["w"],
                               _run(mean.build(), grads, p0)["w"], rtol=1e-5)
    with pytest.raises(ValueError, match=exactly("lr_correction='exact' needs a jdp.OptimizerSpec (it changes the "
                                                 "spec's scale-dependent hyperparameters), not a bare optax "
                                                 "transformation.")):
        for_reduction(mean.build(), "exact", 4)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_config_sum_exact_with_a_schedule_runs_as_the_mean(name):
    """A config with reduction sum, lr_correction exact and cosine decay takes the mean config's steps."""
    over = ["model.name=linear", "data.name=seed_linear", "data.batch_size=8", f"optim.name={name}", "optim.lr=0.1",
            "optim.schedule=cosine", "optim.warmup_steps=1", "train.steps=4", "optim.clip_norm=2.0"]
    batch = load_seed_regression(2).take(np.arange(8))
    params = {}
    for key, extra in {"mean": [], "sum": ["parallel.reduction=sum", "parallel.lr_correction=exact"]}.items():
        step = _linear_step(load_config(None, [*over, *extra]), 4)
        state = step.init({"w": np.array([0.5, -0.3], np.float32)})
        for _ in range(4):
            state, _ = step(state, batch)
        params[key] = jdp.get_params(state)["w"]
    np.testing.assert_allclose(params["sum"], params["mean"], rtol=1e-5, atol=1e-7)
    assert not np.allclose(params["mean"], [0.5, -0.3])


def test_other_lr_corrections_load_with_sum():
    for value in ["auto", "none", "null", "exact"]:
        cfg = load_config(None, ["parallel.reduction=sum", f"parallel.lr_correction={value}"])
        assert cfg.parallel.lr_correction == (None if value == "null" else value)


# run_identity and config_hash.
def test_run_identity_is_the_config_minus_cadence_and_device_count():
    identity = run_identity(Config())
    assert json.loads(json.dumps(identity)) == identity
    assert "devices" not in identity["parallel"] and "log_every" not in identity["train"]
    assert identity["train"] == {"seed": 0, "precision": "float32"}  # a constant schedule does not use train.steps
    assert run_identity(load_config(None, ["optim.schedule=cosine"]))["train"] == {"steps": 300, "seed": 0,
                                                                                 "precision": "float32"}
    assert identity["model"] == Config().to_dict()["model"]


def test_config_hash_ignores_cadence_and_device_count():
    base = config_hash(Config())
    assert len(base) == 64 and base == config_hash(load_config(None))
    for override in ["train.log_every=7", "parallel.devices=2", "train.checkpoint_every=10", "train.eval_every=5",
                     "train.keep_checkpoints=1", "data.eval_batch_size=64", "train.max_nonfinite=0", "train.steps=301",
                     "parallel.shard_optimizer_state=true", "parallel.shard_params=true", "train.profile_steps='2:3'",
                     ["parallel.shard_params=true", "parallel.replicas=2"]]:
        override = override if isinstance(override, list) else [override]
        assert config_hash(load_config(None, override)) == base, override
    for override in ["optim.lr=1e-3", "model.hidden=[64]", "train.seed=1", "data.batch_size=64",
                     "parallel.reduction=sum", "parallel.accum_steps=2", "optim.linear_scaling=true"]:
        assert config_hash(load_config(None, [override])) != base, override
    assert set(HASH_EXCLUDED) == {"data.eval_batch_size", "data.val_path", "data.threads", "data.workers",
                                  "parallel.devices", "parallel.shard_optimizer_state", "parallel.shard_params",
                                  "parallel.replicas", "train.log_every", "train.eval_every", "train.checkpoint_every",
                                  "train.keep_checkpoints", "train.max_nonfinite", "train.profile_steps"}


def test_config_hash_is_stable_across_processes_and_key_order(tmp_path):
    a = write(tmp_path, "train:\n  steps: 5\n  seed: 3\noptim:\n  name: sgd\n  lr: 0.1\n", "a.yaml")
    b = write(tmp_path, "optim:\n  lr: 0.1\n  name: sgd\ntrain:\n  seed: 3\n  steps: 5\n", "b.yaml")
    here = config_hash(load_config(a))
    assert here == config_hash(load_config(b))
    code = "import sys; from jdp.config import load_config, config_hash; print(config_hash(load_config(sys.argv[1])))"
    env = {**os.environ, "PYTHONHASHSEED": "123", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code, a], capture_output=True, text=True, env=env, cwd=ROOT,
                         check=True)
    assert out.stdout.strip() == here


def test_steps_shorter_than_the_warmup_keep_its_fraction_and_a_set_warmup_wins():
    """`jdp train char_gpt --steps 20`: its cosine decays to 0 at step 20, before its 40 warmup
    steps end, which the optimizer refuses; the run keeps the config's fraction (40 of 400 -> 2 of 20)
    and says so. Nothing else changes: a --steps the warmup fits, a constant schedule, or an
    optim.warmup_steps the user set, even one that is then refused."""
    path = os.path.join(ROOT, "jdp", "configs", "char_gpt.yaml")
    overrides, line = steps_override(path, [], 20)
    assert overrides == ["train.steps=20", "optim.warmup_steps=2"]
    assert line == "optim.warmup_steps 40 -> 2: --steps 20 keeps the config's warmup fraction (40 of 400 steps)"
    identity = run_identity(load_config(path, overrides))  # the run's own config: a resume must match it
    assert (identity["optim"]["warmup_steps"], identity["train"]["steps"]) == (2, 20)
    assert steps_override(path, [], 40)[0] == ["train.steps=40", "optim.warmup_steps=4"]  # 40 is not shorter than 40
    assert steps_override(path, [], 1)[0] == ["train.steps=1", "optim.warmup_steps=0"]
    assert steps_override(path, ["train.steps=300"], 20)[0] == ["train.steps=20", "optim.warmup_steps=3"]  # 2.67
    assert steps_override(path, ["train.steps=40"], 20)[0] == ["train.steps=20", "optim.warmup_steps=19"]
    for sets, steps in (([], 41), (["optim.schedule=constant"], 20), (["optim.warmup_steps=40"], 20),
                        ([" optim.warmup_steps = 40"], 20)):
        assert steps_override(path, sets, steps) == ([f"train.steps={steps}"], None), (sets, steps)
    with pytest.raises(ConfigError, match=exactly(
            "optim.warmup_steps: warmup_steps=40 must be less than decay_steps=20, since schedule='cosine' decays "
            "to 0 at decay_steps.")):
        load_config(path, ["optim.warmup_steps=40", "train.steps=20"])
