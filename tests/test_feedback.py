"""Fast feedback: `jdp explain`'s progress and reuse of compiled steps, a finished run that says so
and repeats its held-out result, `--steps` extending a finished run, a plot of one point, help text."""
import argparse
import json
import os
import pathlib

import jax
import numpy as np
import pytest

import jdp.run.cli
from jdp.inspect import explain as ex
from jdp.inspect import explain_common as common
from jdp.run.checkpoint import latest_params
from jdp.config import load_config, run_identity
from jdp.run.metrics import curves_figure
from jdp.core.optim import OptimizerSpec
from jdp.train import train

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEED_CONFIG = str(ROOT / "configs" / "seed_linear.yaml")
TINY_MLP = ["--set", "model.hidden=[8]", "--set", "data.batch_size=32", "--devices", "2", "--no-progress"]


def _stub_explain_parts(monkeypatch):
    """The parts of `explain()` made instant; those with items still report each as it starts."""
    def items(*whats):
        def part(*args, progress=None, **kwargs):
            for k, what in enumerate(whats, 1):
                progress(k, len(whats), what)
            return [{"optimizer": "sgd", "clip": False, "clip_norm": None, "reduction": "mean", "devices": 2,
                     "max_abs_dparam": 0.0}]
        return part

    monkeypatch.setattr(ex, "seed_single_param", lambda backend: {"part": 1})
    monkeypatch.setattr(ex, "seed_two_params", lambda backend: {"part": 2})
    monkeypatch.setattr(ex, "deviation_matrix", items("sgd, clip off", "sgd, clip on"))
    monkeypatch.setattr(ex.explain_precision, "bf16_communication", items("sgd, float32", "bytes"))
    monkeypatch.setattr(ex, "adam_eps_sweep", items("loss × 1"))
    monkeypatch.setattr(ex, "clipping_rates", items("mean", "sum raw"))
    monkeypatch.setattr(ex, "fp16_overflow", lambda n: {})
    monkeypatch.setattr(ex.explain_tokens, "token_normalisations", items("own count", "jdp.Weighted"))


def test_explain_json_keeps_stdout_for_the_json_and_reports_progress_on_stderr(monkeypatch, capsys):
    _stub_explain_parts(monkeypatch)
    assert jdp.run.cli.main(["explain", "--json", "--devices", "2"]) == 0
    out, err = capsys.readouterr()
    results = json.loads(out)  # stdout is the JSON document and nothing else
    assert results["seed_single_param"] == {"part": 1} and results["matrix"][0]["devices"] == 2
    first, *parts = err.splitlines()  # what it will do and what that cost when measured, then each part
    assert first == ("jdp explain: 8 parts, ~120 steps to compile on 8 fake CPU devices; 434-466 s measured on a "
                     "2-core CPU shared with other work (load average 7-8)")
    assert parts == [f"jdp explain: part {line}" for line in (
        "1 of 8: seed regression 1", "2 of 8: seed regression 2",
        "3 of 8: deviation matrix", "3 of 8: deviation matrix, 1 of 2 (sgd, clip off)",
        "3 of 8: deviation matrix, 2 of 2 (sgd, clip on)",
        "4 of 8: bf16 gradient communication", "4 of 8: bf16 gradient communication, 1 of 2 (sgd, float32)",
        "4 of 8: bf16 gradient communication, 2 of 2 (bytes)",
        "5 of 8: Adam ε sweep", "5 of 8: Adam ε sweep, 1 of 1 (loss × 1)",
        "6 of 8: clipping rates", "6 of 8: clipping rates, 1 of 2 (mean)", "6 of 8: clipping rates, 2 of 2 (sum raw)",
        "7 of 8: fp16 overflow", "8 of 8: token-weighted means",
        "8 of 8: token-weighted means, 1 of 2 (own count)", "8 of 8: token-weighted means, 2 of 2 (jdp.Weighted)")]


def test_explain_reuses_compiled_steps_across_its_parts(monkeypatch):
    """The ε sweep runs every loss scale on one compiled step per reduction, and the clip threshold
    on the step of the matrix's SGD reference; explain() leaves no steps cached."""
    built = []
    real = common.make_train_step
    monkeypatch.setattr(common, "make_train_step", lambda *a, **k: built.append(k["reduction"]) or real(*a, **k))
    common.cached_step.cache_clear()
    sweep = ex.adam_eps_sweep(n=2, scales=(1.0, 1e-3, 1e-9))
    assert sorted(built) == ["mean", "sum"]  # 2 compiled steps for 6 runs
    assert sweep[0]["relative_deviation"] < 1e-3 < 0.5 < sweep[2]["relative_deviation"]
    problem = ex.Problem.make(steps=1)
    ex.clip_threshold(problem)
    common.train_problem(problem, OptimizerSpec("sgd", lr=0.1), "mean", None, 1)
    assert len(built) == 3
    assert common.cached_step.cache_info().currsize == 3
    _stub_explain_parts(monkeypatch)
    ex.explain((2,))
    assert common.cached_step.cache_info().currsize == 0


def test_a_finished_run_says_so_and_repeats_its_held_out_result(tmp_path, capsys):
    work = str(tmp_path / "run")
    args = ["train", "--steps", "4", "--workdir", work, *TINY_MLP]
    assert jdp.run.cli.main(args) == 0
    first = capsys.readouterr().out.splitlines()[-1]
    assert first.startswith("done at step 4 of 4") and "held-out accuracy" in first
    assert jdp.run.cli.main(args) == 0
    again = capsys.readouterr().out.splitlines()[-1]
    assert again.startswith("the run is complete (4 of 4 steps")
    assert again.split("held-out")[1] == first.split("held-out")[1]  # the same numbers, from the restored state
    config = load_config(None, ["train.steps=4", "model.hidden=[8]", "data.batch_size=32"])
    result = train(config, work, devices=jax.devices()[:2], log=lambda *_: None, progress=False)
    assert result.resumed_from == result.steps == 4 and result.final_loss is None
    assert f"accuracy {result.eval['accuracy']:.4f}" in first


def _losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def _snapshot(directory):
    return {os.path.relpath(os.path.join(d, f), directory): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, files in os.walk(directory) for f in files}


def test_more_steps_extend_a_finished_run_with_a_constant_schedule(tmp_path, capsys):
    short, whole = str(tmp_path / "short"), str(tmp_path / "whole")
    base = ["train", SEED_CONFIG, "--no-progress", "--set", "optim.warmup_steps=2"]  # warmup, then constant
    assert jdp.run.cli.main([*base, "--steps", "4", "--workdir", short]) == 0
    assert jdp.run.cli.main([*base, "--steps", "6", "--workdir", short]) == 0
    assert "resumed from step 4" in capsys.readouterr().out
    assert jdp.run.cli.main([*base, "--steps", "6", "--workdir", whole]) == 0
    assert latest_params(short)[0] == 6
    np.testing.assert_array_equal(latest_params(short)[1]["w"], latest_params(whole)[1]["w"])  # bit for bit
    assert _losses(short) == _losses(whole)
    before = _snapshot(short)  # fewer steps than trained: refused, nothing changed
    assert jdp.run.cli.main([*base, "--steps", "5", "--workdir", short]) == 2
    assert "train.steps=5 is fewer than the 6 steps" in capsys.readouterr().err
    assert _snapshot(short) == before


def test_steps_shorter_than_the_warmup_run_with_its_fraction_and_resume_as_they_ran(tmp_path, capsys):
    """`--steps` shorter than the config's warmup (10 of 40 steps, cosine): the run takes 1 of 4,
    says so in one line, and the same command again finds the run complete; an optim.warmup_steps
    set on the command line is taken as it is (here: refused)."""
    config = tmp_path / "c.yaml"
    with open(SEED_CONFIG) as f:
        config.write_text(f.read().replace("  lr: 0.1\n", "  lr: 0.1\n  schedule: cosine\n  warmup_steps: 10\n")
                          .replace("  steps: 1\n", "  steps: 40\n"))
    base = ["train", str(config), "--no-progress", "--steps", "4", "--workdir", str(tmp_path / "w")]
    assert jdp.run.cli.main(base) == 0
    out = capsys.readouterr().out
    assert out.startswith("optim.warmup_steps 10 -> 1: --steps 4 keeps the config's warmup fraction (10 of 40 "
                          "steps)\n") and "done at step 4 of 4" in out, out
    assert jdp.run.cli.main(base) == 0  # the identity holds the scaled warmup: the same command matches it
    assert "the run is complete (4 of 4 steps, trained earlier)" in capsys.readouterr().out
    assert jdp.run.cli.main([*base, "--set", "optim.warmup_steps=10"]) == 2  # the user's own value: never scaled
    assert "warmup_steps=10 must be less than decay_steps=4" in capsys.readouterr().err


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_changing_steps_is_refused_where_the_schedule_uses_them(tmp_path, capsys, schedule):
    work = str(tmp_path / "w")
    base = ["train", SEED_CONFIG, "--no-progress", "--workdir", work, "--set", f"optim.schedule={schedule}"]
    assert jdp.run.cli.main([*base, "--steps", "4"]) == 0
    capsys.readouterr()
    before = _snapshot(work)
    assert jdp.run.cli.main([*base, "--steps", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jdp: error: train.steps=6 differs from the run's 4") and err.count("\n") == 0
    assert f"optim.schedule='{schedule}' decays the learning rate to 0 at train.steps" in err
    assert _snapshot(work) == before


def test_train_steps_is_in_the_run_identity_exactly_when_the_schedule_uses_it():
    def has_steps(*overrides):
        return "steps" in run_identity(load_config(None, list(overrides)))["train"]

    assert not has_steps() and not has_steps("optim.warmup_steps=10")
    assert has_steps("optim.schedule=cosine") and has_steps("optim.schedule=linear", "optim.warmup_steps=10")


def test_a_series_of_one_point_is_drawn_with_a_marker(tmp_path):
    import matplotlib.pyplot as plt

    fig = curves_figure([{"step": 3, "loss": 1.5, "train_accuracy": 0.25},
                         {"step": 3, "eval_loss": 1.7, "eval_accuracy": 0.2}])
    try:
        lines = {line.get_gid(): line for ax in fig.axes for line in ax.lines}  # gid: the metrics key
        assert set(lines) == {"loss", "train_accuracy", "eval_loss", "eval_accuracy"}
        for line in lines.values():
            assert line.get_marker() == "o" and len(line.get_xydata()) == 1
        assert lines["loss"].get_xydata().tolist() == [[3.0, 1.5]]
    finally:
        plt.close(fig)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    assert jdp.run.cli.main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_every_option_of_every_subcommand_has_help():
    parser = jdp.run.cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = [f"{name} {action.option_strings or action.dest}" for name, command in commands.items()
               for action in command._actions if not (action.help or "").strip() or action.help == argparse.SUPPRESS]
    assert not missing and set(commands) == {"train", "plot", "explain", "config", "configs", "data", "memory",
                                                     "sample", "export"}


def test_explain_progress_on_a_terminal_is_a_rich_bar():
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    with ex.progress_to(stream) as progress:
        progress(ex.Progress(3, "deviation matrix"))
        progress(ex.Progress(3, "deviation matrix", 2, 8, "sgd, clip on"))
    assert "jdp explain: part 3/8 deviation matrix" in stream.getvalue()


def test_a_checkpoint_that_counted_steps_with_a_constant_schedule_may_be_extended(tmp_path, monkeypatch):
    """Checkpoints written before train.steps left the identity of constant schedules hold it."""
    import jdp.run.facts

    work, cfg = str(tmp_path / "w"), load_config(SEED_CONFIG, ["train.steps=2"])

    def quiet(config):
        return train(config, work, devices=jax.devices()[:4], log=lambda *_: None, progress=False)

    with monkeypatch.context() as old_jdp:
        old_jdp.setattr(jdp.run.facts, "run_identity", lambda config: {**run_identity(config), "train": {
            "steps": config.train.steps, "seed": config.train.seed}})
        quiet(cfg)
    assert quiet(cfg).resumed_from == 2  # the same length: resumes as before
    assert quiet(load_config(SEED_CONFIG, ["train.steps=3"])).steps == 3
