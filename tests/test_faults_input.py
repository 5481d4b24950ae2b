"""Input limits, checked before anything big is allocated: YAML configs, JDP_CPU_THREADS.

Each fault runs as a user meets it where that is cheap: `jdp.cli.main([...])` in this process (exit
code 2, one `jdp: error:` sentence, no traceback, nothing written: the checks of tests/test_faults.py),
or the API call that raises. Only the JDP_CPU_THREADS case starts a process, since what `import jdp`
does with it is the point.
"""
import io
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from types import SimpleNamespace

import optax
import pytest

import jdp
from jdp.cli import main
from jdp.config import ConfigError, config_from_dict, load_config
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
    from jdp.sections import parse_yaml
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


# JDP_CPU_THREADS: `import jdp` cannot fail (the CLI would print a traceback); jdp refuses it at its next use.
def test_bad_cpu_threads_exits_2_on_the_command_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC", "NPROC")}
    r = subprocess.run([sys.executable, "-W", "error", "-m", "jdp.cli", "train", "--workdir", str(tmp_path / "w")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env={**env, "JDP_CPU_THREADS": "4O"})
    assert_refused(r, "jdp: error: JDP_CPU_THREADS='4O' must be 'xla' or a number of threads from 1 to 4096.")
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("value", ["abc", "0", "4097", "10" * 300, "٤"])
def test_bad_cpu_threads_is_refused_by_every_step(monkeypatch, value):
    monkeypatch.setenv("JDP_CPU_THREADS", value)
    pattern = r"^JDP_CPU_THREADS=.{3,200} must be 'xla' or a number of threads from 1 to 4096\.$"
    with pytest.raises(ValueError, match=pattern):
        jdp.make_train_step(lambda params, batch: 0.0, optax.sgd(0.1))
    with pytest.raises(ValueError, match=pattern):
        jdp.cpu.use_cpu_devices(8)
    monkeypatch.setenv("JDP_CPU_THREADS", " 8 ")
    assert jdp.cpu.threads_choice() == 8

