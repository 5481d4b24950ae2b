"""The `jdp` command end to end, in fresh processes (so it sets up its own fake devices)."""
import re
import subprocess
import sys

import pytest


def run_jdp(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "jdp.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_train_runs_and_learns():
    r = run_jdp("train", "--devices", "2", "--steps", "120", "--log-every", "60")
    assert r.returncode == 0, r.stderr
    assert "on 2 cpu device(s)" in r.stdout
    accuracy = float(re.search(r"test accuracy (\d\.\d+)", r.stdout).group(1))
    assert accuracy > 0.9


@pytest.mark.parametrize("args,message", [
    (["train", "--devices", "0"], "argument --devices: 0 must be at least 1"),
    (["train", "--steps", "x"], "argument --steps: 'x' is not an integer"),
    (["train", "--lr", "-1"], "argument --lr: -1.0 must be positive"),
    (["train", "--backend", "tpu"], "argument --backend: invalid choice: 'tpu'"),
    (["train", "--devices", "3", "--batch-size", "128"],
     "global batch size 128 does not divide evenly across 3 devices"),
    (["train", "--devices", "2", "--batch-size", "4000"], "the dataset has 1438 examples, fewer than one global batch of 4000"),
])
def test_bad_input_exits_2_without_traceback(args, message):
    r = run_jdp(*args)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr
