"""Input limits, checked before anything big is allocated: YAML configs, user arrays, JDP_CPU_THREADS.

Each fault runs as a user meets it where that is cheap: `jdp.run.cli.main([...])` in this process (exit
code 2, one `jdp: error:` sentence, no traceback, nothing written: the checks of tests/test_faults.py),
or the API call that raises. Only the JDP_CPU_THREADS case starts a process, since what `import jdp`
does with it is the point.
"""
import io
import os
import subprocess
import sys
import zipfile
from contextlib import redirect_stderr, redirect_stdout
from types import SimpleNamespace

import numpy as np
import optax
import pytest

from benchmarks.common import child_env
import jdp
import jdp.data.npyfile
from jdp.run.cli import main
from jdp.config import ConfigError, config_from_dict, load_config
from jdp.data import load_arrays
from test_faults import ROOT, assert_refused, snapshot


def refused(d, *argv):
    """`jdp train ARGV --workdir {d}/w` in this process: refused in one sentence, `d` unchanged; that sentence."""
    before = snapshot(d)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["train", *argv, "--workdir", f"{d}/w", "--no-progress", "--stop-after", "1"])  # if not refused
    r = SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())
    assert_refused(r)
    assert snapshot(d) == before
    return r.stderr.strip().removeprefix("jdp: error: ")


# YAML: (id, the text of {dir}/c.yaml, the whole message after "{dir}/c.yaml: ")
LAUGHS = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 9))  # 9^9 values
YAML_CASES = [
    ("section-twice", "optim:\n  lr: 0.1\ntrain:\n  steps: 3\noptim:\n  name: sgd\n",
     "the key 'optim' appears twice in one mapping, at lines 1 and 5; write it once (YAML would keep only the last)."),
    ("key-twice-in-a-section", "optim:\n  lr: 0.1\n  name: sgd\n  'lr': 0.2\n",
     "the key 'lr' appears twice in one mapping, at lines 2 and 4; write it once (YAML would keep only the last)."),
    ("nested-5000-deep", "train:\n  seed: " + "[" * 5000 + "]" * 5000 + "\n",
     "the value at line 2 is nested more than 16 levels deep; a config needs 4 (section, key, list, item)."),
    ("billion-laughs", "l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + LAUGHS,
     "the value at line 5 holds 66430 values (aliases counted in full); a config may hold at most 10000."),
    ("aliases-nested-deep", "a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 20)),
     "the value at line 16 is nested 17 levels deep through its aliases; a config may nest at most 16."),
    ("recursive-alias", "model: &m\n  hidden: *m\n",
     "the alias *m at line 2 refers to a value that contains it; a config cannot be recursive."),
    ("seed-of-65-bits", "train:\n  seed: 18446744073709551616\n",
     "the integer 18446744073709551616 at line 2 does not fit in 64 bits; integers must lie between "
     "-9223372036854775808 and 9223372036854775807."),
    ("lr-of-5000-digits", "optim:\n  lr: " + "9" * 5000 + "\n",
     f"the integer {'9' * 197}... at line 2 does not fit in 64 bits; integers must lie between "
     f"-9223372036854775808 and 9223372036854775807."),
]


@pytest.mark.parametrize("text,message", [c[1:] for c in YAML_CASES], ids=[c[0] for c in YAML_CASES])
def test_yaml_beyond_limits_is_refused(tmp_path, text, message):
    (tmp_path / "c.yaml").write_text(text)
    assert refused(tmp_path, str(tmp_path / "c.yaml")) == f"{tmp_path}/c.yaml: {message}"


def test_yaml_merge_keys_may_repeat_a_key():
    from jdp.run.sections import parse_yaml
    text = "base: &b {lr: 0.1, name: sgd}\noptim: {<<: *b, lr: 0.2}\n"
    assert parse_yaml(text, "c.yaml")["optim"] == {"lr": 0.2, "name": "sgd"}


@pytest.mark.parametrize("override,message", [
    ("optim.lr=" + "9" * 400, f"the override of optim.lr: the integer {'9' * 197}... at line 1 does not fit in 64 "
     f"bits; integers must lie between -9223372036854775808 and 9223372036854775807."),
    ("train.steps=4294967296", "train.steps must be a positive integer up to 2147483647, got 4294967296."),
    ("model.name=" + "x" * 100_000, f"model.name must be one of mlp, cnn, gpt, linear, got '{'x' * 196}...."),
    ("optim.lr=[" + "1, " * 9_999 + "1]",
     "the override of optim.lr: the value at line 1 holds 10001 values (aliases counted in full); a config may "
     "hold at most 10000."),
], ids=["float-of-400-digits", "steps-beyond-32-bits", "long-string", "long-list"])
def test_override_beyond_limits_is_refused_in_a_short_sentence(tmp_path, override, message):
    assert refused(tmp_path, "--set", override) == message


@pytest.mark.parametrize("data,message", [
    ({"optim": {"lr": 10**400}}, "optim.lr must be a positive number, got an integer of 1329 bits."),
    ({"train": {"seed": 2**64}},
     "train.seed must be an integer of at least 0 up to 9223372036854775807, got 18446744073709551616."),
    ({"model": {"hidden": [64, 2**31]}},  # on the command line it would be built: 512 GiB of weights
     "model.hidden must be a list of positive integers up to 2147483647, got [64, 2147483648]."),
    ({"optim": {"k" * 10_000: 1}}, f"unknown key 'optim.{'k' * 190}...; optim has: "),
    ({"model": {"hidden": [[[1]] * 10**6]}}, "model.hidden must be a list of positive integers, got [[[1], [1], [1], "),
], ids=["float-of-1329-bits", "seed-of-65-bits", "width-beyond-32-bits", "long-key", "long-list"])
def test_api_values_beyond_limits_raise_one_short_sentence(data, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert str(e.value).startswith(message) and len(str(e.value)) < 400, str(e.value)[:1000]


def test_seed_may_use_64_bits():
    assert load_config(None, ["train.seed=9223372036854775807"]).train.seed == 2**63 - 1


# User arrays, {dir}/d.npz (data.name=arrays), refused before the model or the workdir exists.
X = np.random.default_rng(0).normal(size=(40, 5))
Y = np.arange(40) % 3
ARRAYS = ["--devices", "2", "--steps", "2", "--set", "data.name=arrays", "--set", "data.batch_size=8"]


def arrays_refused(d, *args, **arrays):
    np.savez(d / "d.npz", **arrays)
    return refused(d, *ARRAYS, "--set", f"data.path={d}/d.npz", *args)


def test_float64_beyond_float32_is_refused(tmp_path):
    x = X.copy()
    x[3, 1] = -1e39  # the float32 cast would make it -inf and train on it
    assert arrays_refused(tmp_path, x=x, y=Y) == (
        f"data.path '{tmp_path}/d.npz': array 'x' has the value -1e+39, beyond float32's range (±3.40282e+38), "
        f"which jdp casts it to; rescale it.")


def test_linear_targets_beyond_float32_are_refused(tmp_path):
    assert arrays_refused(tmp_path, "--set", "model.name=linear", x=X, y=np.where(Y == 1, 1e300, 0.5)) == (
        f"data.path '{tmp_path}/d.npz': array 'y' has the value 1e+300, beyond float32's range (±3.40282e+38), "
        f"which jdp casts it to; rescale it.")


@pytest.mark.parametrize("label", [2**40, 1024])  # 40 examples: labels 0 to 1023
def test_label_beyond_the_class_limit_is_refused_before_the_model_is_sized(tmp_path, label):
    y = Y.copy()
    y[7] = label  # one output unit per label up to the largest: 2^40 would ask for terabytes
    assert arrays_refused(tmp_path, x=X, y=y) == (
        f"data.path '{tmp_path}/d.npz': array 'y' has the label {label}; with 40 examples the mlp takes labels 0 to "
        f"1023 (max(n, 1024) classes: each label up to the largest is an output).")


def _npy_claiming(shape, data=b"\0" * 16) -> bytes:
    """A .npy file whose header claims `shape` of float32 but which holds only `data`."""
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": shape})
    return f.getvalue() + data


@pytest.mark.parametrize("method", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED], ids=["stored", "deflated"])
def test_npz_header_claiming_a_huge_shape_is_refused_before_allocating(tmp_path, method):
    with zipfile.ZipFile(tmp_path / "d.npz", "w", method) as zf:
        zf.writestr("x.npy", _npy_claiming((2**40, 5)))
        zf.writestr("y.npy", _npy_claiming((40,)))
    message = refused(tmp_path, *ARRAYS, "--set", f"data.path={tmp_path}/d.npz")
    assert message.startswith(f"'{tmp_path}/d.npz' array 'x' claims shape (1099511627776, 5) of float32 (20.0 TiB), "
                              f"but the file holds at most "), message
    assert message.endswith(" of it; the file is damaged or was not written by numpy."), message


def test_npy_header_claiming_more_than_the_file_is_refused(tmp_path):
    (tmp_path / "a.npy").write_bytes(_npy_claiming((5,)))  # 20 bytes claimed, 16 held
    with pytest.raises(ValueError, match=r"^'.*a.npy' array 'x' claims shape \(5,\) of float32 \(20 bytes\), but the "
                                         r"file holds at most 16 bytes of it; the file is damaged"):
        load_arrays(tmp_path / "a.npy")
    (tmp_path / "b.npy").write_bytes(_npy_claiming((4,)))  # exactly what it holds
    assert load_arrays(tmp_path / "b.npy").arrays["x"].shape == (4,)


def test_arrays_beyond_memory_are_refused(tmp_path, monkeypatch):
    np.savez_compressed(tmp_path / "d.npz", x=np.zeros((40, 5), np.float32), y=Y)
    monkeypatch.setattr(jdp.data.npyfile, "memory_bytes", lambda: 1000)  # 800 + 320 bytes of arrays
    with pytest.raises(ValueError, match=r"d.npz' holds 1.1 KiB of arrays, more than this machine's 1000 bytes of "
                                         r"memory; load a part of it\.$"):
        load_arrays(tmp_path / "d.npz")


# JDP_CPU_THREADS: `import jdp` cannot fail (the CLI would print a traceback); jdp refuses it at its next use.
def test_bad_cpu_threads_exits_2_on_the_command_line(tmp_path):
    env = child_env()
    r = subprocess.run([sys.executable, "-W", "error", "-m", "jdp.run.cli", "train", "--workdir", str(tmp_path / "w")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env={**env, "JDP_CPU_THREADS": "4O"})
    assert_refused(r, "jdp: error: JDP_CPU_THREADS='4O' must be 'xla' or a number of threads from 1 to 4096.")
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("value", ["abc", "0", "4097", "10" * 300, "٤"],
                         ids=["letters", "zero", "above-4096", "600-digits", "arabic-indic-digit"])
def test_bad_cpu_threads_is_refused_by_every_step(monkeypatch, value):
    monkeypatch.setenv("JDP_CPU_THREADS", value)
    pattern = r"^JDP_CPU_THREADS=.{3,200} must be 'xla' or a number of threads from 1 to 4096\.$"
    with pytest.raises(ValueError, match=pattern):
        jdp.make_train_step(lambda params, batch: 0.0, optax.sgd(0.1))
    with pytest.raises(ValueError, match=pattern):
        jdp.cpu.use_cpu_devices(8)
    monkeypatch.setenv("JDP_CPU_THREADS", " 8 ")
    assert jdp.cpu.threads_choice() == 8



def test_zero_features_are_named_by_array(tmp_path):
    assert arrays_refused(tmp_path, x=np.zeros((40, 0)), y=Y) == (
        f"data.path '{tmp_path}/d.npz': array 'x' has shape (40, 0): zero features per example, so there is nothing "
        f"to train on; save the inputs as 'x' with at least one feature.")


def test_a_test_fraction_that_leaves_no_training_example_is_named_by_its_key(tmp_path):
    assert arrays_refused(tmp_path, "--set", "data.test_fraction=0.99", x=X, y=Y) == (
        f"data.test_fraction=0.99 holds out round(40 × 0.99) = 40 of the 40 examples of data.path "
        f"'{tmp_path}/d.npz' (arrays 'x' and 'y'), leaving no training example; lower data.test_fraction or add "
        f"examples.")


def test_an_empty_workdir_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # today's jdp trained in runs/digits_mlp there
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["train", "--steps", "2", "--workdir", "", "--no-progress"])
    assert_refused(SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue()))
    assert err.getvalue() == ("jdp: error: --workdir '' is empty; name the run's directory (or leave --workdir out "
                              "for runs/<config name>).\n")
    assert os.listdir(tmp_path) == []


def test_a_test_fraction_that_leaves_no_digits_training_example_is_named_by_its_key():
    with pytest.raises(ConfigError, match=r"data.test_fraction=0.9999 holds out round\(1797 × 0.9999\) = 1797 of the "
                                          r"1797 digits examples \(arrays 'x' and 'y'\), leaving no training example"):
        load_config(None, ["data.test_fraction=0.9999", "data.drop_last=false"])
