"""The example scripts, run as a user would: a fresh process with its own 4 fake CPU devices.

examples/linen_mlp.py is run by tests/test_models.py. Warnings are errors here too (`-W error`).
examples/flax_nnx_tutorial.py (Flax's NNX MNIST tutorial, ported) is run by tests/test_flax_tutorial.py.
"""
import math
import os
import pathlib
import re
import subprocess
import sys

from benchmarks.common import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> str:
    """Run examples/<name> in a subprocess from the repo root; return its stdout after checking rc 0."""
    # conftest's 8-device XLA_FLAGS (and a thread-pool size chosen for it) must not reach the
    # script: it asks for its own 4 devices with jdp.cpu.use_cpu_devices(4).
    env = child_env()
    done = subprocess.run([sys.executable, "-W", "error", str(ROOT / "examples" / name), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-4000:]}"
    return done.stdout


def test_digits_custom_loss_reaches_095_and_replicas_agree():
    out = run_example("digits_custom_loss.py")
    assert "4 devices" in out
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", out).group(1))
    assert accuracy > 0.95, out
    # the aux metric came back from the step: batch accuracy printed every 5 epochs
    assert len(re.findall(r"batch accuracy [0-9.]+", out)) == 5, out
    assert "replicas agree" in out


def test_seed_demo_prints_the_numbers_of_why_average():
    out = run_example("seed_demo.py")
    assert "local gradients: -8.0 and -9.0" in out
    table = {name: (int(n), float(g), float(w)) for name, n, g, w in
             re.findall(r"^(.+?)\s+(\d)\s+(-?[0-9.]+)\s+(-?[0-9.]+)$", out, re.MULTILINE)}
    assert table == {
        "one device, whole batch": (1, -8.5, 1.085),
        "mean (lax.pmean)": (2, -8.5, 1.085),
        'sum, lr_correction="none"': (2, -17.0, 1.17),
        'sum, lr_correction="auto" (lr / 2)': (2, -17.0, 1.085),
    }, out
    two = dict(re.findall(r"^(.+?)\s+w -> \((.+)\)$", out, re.MULTILINE))
    assert two == {"one device": "0.9150, 0.0850", "mean": "0.9150, 0.0850", "sum, raw": "2.1600, 1.2400"}, out


def test_char_gpt_short_run_learns_and_samples():
    out = run_example("char_gpt.py", "--steps", "30")
    assert "4 devices" in out
    vocab_size = int(re.search(r"vocab (\d+)", out).group(1))
    loss = float(re.search(r"^val loss ([0-9.naif]+)", out, re.MULTILINE).group(1))
    assert math.isfinite(loss), out
    assert loss < math.log(vocab_size), out  # below a uniform guess over the vocabulary (≈ 4.6)
    train_loss = float(re.search(r"train loss ([0-9.naif]+)", out).group(1))
    assert math.isfinite(train_loss), out  # printed on an update call, so never the NaN of a held call
    sample = out.split("sample (temperature 0.8):\n", 1)[1]
    assert sample.startswith("The value of ")
    assert len(sample) >= len("The value of ") + 200, out



def test_own_model_through_the_trainer_learns_and_resumes(tmp_path):
    def held_out(text):
        return float(re.search(r"held-out accuracy ([0-9.]+) after 200 steps", text).group(1))

    out = run_example("own_model_trainer.py", str(tmp_path / "run"))
    assert held_out(out) > 0.95, out
    again = run_example("own_model_trainer.py", str(tmp_path / "run"))
    assert "the run is complete" in again and held_out(again) == held_out(out), again  # repeated, not retrained


def test_fsdp_own_model_gathers_per_layer_in_nnx_and_linen():
    out = run_example("fsdp_own_model.py")
    for name in ("nnx", "linen"):  # each equal to one device, with every layer's gradient reduce-scattered in the loop
        assert re.search(rf"^{name}: equal to one device; gathered per layer, by the model \(gather_in_model\); "
                         rf"inside the scan: \d+ all-gathers, 4 reduce-scatters$", out, re.M), out
    page = (ROOT / "docs" / "fsdp.md").read_text(encoding="utf-8")
    quoted = re.search(r"examples/fsdp_own_model\.py\n.*?```text\n(.*?)```", page, re.S).group(1)
    assert quoted.splitlines() == out.splitlines()  # what docs/fsdp.md says it prints
