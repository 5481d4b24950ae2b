"""The `jdp` command end to end, in fresh processes (so it sets up its own fake devices)."""
import json
import subprocess
import sys

import pytest


def run_jdp(*args, timeout=300, cwd=None):
    return subprocess.run([sys.executable, "-m", "jdp.run.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def test_train_logs_checkpoints_plots_and_resumes(tmp_path):
    work = str(tmp_path / "run")
    r = run_jdp("train", "--devices", "2", "--steps", "120", "--log-every", "40", "--workdir", work, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "on 2 cpu device(s)" in r.stdout and "done at step 120 of 120" in r.stdout
    with open(f"{work}/metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [x["step"] for x in records if "loss" in x] == [40, 80, 120]
    # The step's training record comes first, its evaluation after it (a failing evaluation cannot lose it).
    assert [x["step"] for x in records[-2:]] == [120, 120] and "eval_accuracy" not in records[-2]
    for key in ("loss", "grad_norm", "lr", "samples_per_s", "flops_per_s", "train_accuracy"):
        assert records[-2][key] > 0, key
    assert records[-1]["eval_accuracy"] > 0.9
    assert "mfu" not in records[-2]  # no known peak for a CPU: achieved FLOP/s only
    r = run_jdp("plot", work)
    assert r.returncode == 0 and (tmp_path / "run" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    r = run_jdp("train", "--devices", "2", "--steps", "120", "--workdir", work, "--no-progress")
    assert r.returncode == 0 and "resumed from step 120" in r.stdout, r.stdout + r.stderr


def test_seed_config_reaches_the_seed_numbers(tmp_path):
    # By name, from a folder with no configs/ in it: the shipped config travels with the package.
    r = run_jdp("train", "seed_linear", "--workdir", str(tmp_path / "s"), "--no-progress", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "params: ['w'] = [0.915, 0.085]" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["train", "--devices", "0"], "argument --devices: 0 must be at least 1"),
    (["train", "--steps", "x"], "argument --steps: 'x' is not an integer"),
    (["train", "--set", "optim.lrr=1"], "unknown key 'optim.lrr'"),
    (["train", "--set", "optim.lr=-1"], "optim.lr must be a positive number, got -1"),
    (["train", "--set", "parallel.backend=tpu"], "parallel.backend must be one of shard_map, pmap, jit, got 'tpu'"),
    (["train", "no_such.yaml"], "no_such.yaml"),
    (["train", "--devices", "3", "--set", "data.batch_size=128"],
     "data.batch_size=128 is not a multiple of parallel.accum_steps × devices = 1 × 3"),
    (["train", "--devices", "2", "--set", "data.batch_size=4000"], "4000"),
    (["plot", "/nonexistent/dir"], "does not exist"),
    (["explain", "--plot", "out.txt"], "must name a .png file"),
])
def test_bad_input_exits_2_without_traceback(args, message, tmp_path):
    r = run_jdp(*args, "--workdir", str(tmp_path / "w")) if args[0] == "train" else run_jdp(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "w").exists()  # nothing written for a run that never started


def test_workdir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("keep me")
    r = run_jdp("train", "--workdir", str(f), "--steps", "2")
    assert r.returncode == 2 and "exists and is not a directory" in r.stderr and "Traceback" not in r.stderr
    assert f.read_text() == "keep me"


def test_plot_names_a_corrupt_metrics_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{not json\n')
    r = run_jdp("plot", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "metrics.jsonl' line 2 is not JSON" in r.stderr
