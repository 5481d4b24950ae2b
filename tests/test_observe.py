"""Watching a run: the first step's time apart from the throughput, the console, a profile of a
range of steps (`jax.profiler`, read back from its Perfetto trace) and a W&B offline run (read
back from its transaction log with wandb's own protobuf records)."""
import glob
import gzip
import json
import os
import struct

import jax
import pytest

from jdp.run.config import load_config
from jdp.run.metrics import MetricsWriter
from jdp.run.sections import ConfigError
from jdp.run.train import train

TINY = ["model.hidden=[8]", "data.batch_size=32"]


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_the_first_step_is_timed_once_and_left_out_of_samples_per_s(tmp_path):
    lines = []
    train(load_config(None, [*TINY, "train.steps=4", "train.log_every=1"]), str(tmp_path / "r"),
          devices=jax.devices()[:2], log=lines.append, progress=False)
    records = [r for r in _records(tmp_path / "r") if "loss" in r]
    first = records[0]
    assert first["step"] == 1 and first["compile_s"] > 0 and "samples_per_s" not in first
    assert sum("compiled and ran in" in line for line in lines) == 1
    assert [r["step"] for r in records if "samples_per_s" in r] == [2, 3, 4]
    # Step 2 alone (no compilation in it) runs far faster than the first step did.
    assert records[1]["samples_per_s"] > 10 * 32 / first["compile_s"]
    assert [line.split()[1] for line in lines if " grad_norm " in line] == ["1", "2", "3", "4"]


def test_the_progress_bar_shows_below_the_step_lines_and_goes_when_the_run_ends(tmp_path):
    lines = []
    with MetricsWriter(str(tmp_path), total=2, start=0, log=lines.append, progress=True) as writer:
        writer.write({"step": 1, "loss": 0.5, "grad_norm": 1.0, "lr": 0.1, "samples_per_s": 10.0})
        assert writer._bar.live.transient  # rich erases a transient display when it stops
    assert lines == ["step      1  loss 0.5000  grad_norm 1.000  lr 1.00e-01  10 samples/s"]


def _traced_steps(profile_dir) -> list[int]:
    (trace,) = glob.glob(os.path.join(profile_dir, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    with gzip.open(trace) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    return sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train" and "step_num" in e.get("args", {}))


def test_profile_steps_writes_a_trace_of_those_steps_into_the_workdir(tmp_path):
    work = tmp_path / "p"
    lines = []
    train(load_config(None, [*TINY, "train.steps=8", "train.profile_steps='3:5'"]), str(work),
          devices=jax.devices()[:2], log=lines.append, progress=False)
    assert _traced_steps(work / "profile") == [3, 4, 5]
    assert glob.glob(str(work / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))  # TensorBoard's plugin
    assert any(line.startswith(f"profile of steps 3..5 written to {work / 'profile'}") for line in lines)
    for bad in ("5:3", "0:2", "3", "a:b"):
        with pytest.raises(ConfigError, match="train.profile_steps must be null or 'FIRST:LAST'"):
            load_config(None, [f"train.profile_steps='{bad}'"])


def _wandb_records(run_file: str) -> list:
    """The records of a W&B transaction log (.wandb): LevelDB-style 32 KiB blocks of chunks, each with
    a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last), after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    with open(run_file, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    records, chunk, pos = [], b"", 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def test_a_wandb_offline_run_holds_the_config_every_record_and_the_runs_identity(tmp_path):
    pytest.importorskip("wandb")
    from jdp.run.facts import RunFacts

    config = load_config(None, [*TINY, "train.steps=6", "train.log_every=2"])
    work = tmp_path / "w"
    train(config, str(work), devices=jax.devices()[:2], log=lambda *_: None, progress=False, wandb=True)
    (run_file,) = glob.glob(str(work / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = _wandb_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config_hash = RunFacts.of(config, jax.devices()[:2]).config_hash
    assert run.run_id == config_hash[:16] and run.project == "jdp" and run.display_name == "w"
    logged = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert logged["model"]["hidden"] == [8] and logged["train"]["steps"] == 6
    assert logged["jdp"]["config_hash"] == config_hash and logged["jdp"]["devices"] == 2
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in records
               if r.WhichOneof("record_type") == "history"]
    expected = {}  # every record metrics.jsonl has, at its step (W&B joins a step's records in one row)
    for r in _records(work):
        expected.setdefault(r["step"], {}).update({k: v for k, v in r.items() if k != "step"})
    assert [h["_step"] for h in history] == list(expected) == [1, 2, 4, 6]
    for h, (step, values) in zip(history, expected.items()):
        assert {k: h[k] for k in values} == pytest.approx(values), step


class _Clock:
    """time.perf_counter for jdp.run.records: the times given, in turn."""

    def __init__(self, *times):
        self.times = list(times)

    def perf_counter(self):
        return self.times.pop(0)


def test_samples_per_s_counts_each_interval_from_the_end_of_the_one_before(monkeypatch):
    # started at 0 s, the first step ends at 10 s (compilation); log steps at 12 s (step 5) and 13 s (step 9)
    import jdp.run.records

    monkeypatch.setattr(jdp.run.records, "time", _Clock(0.0, 10.0, 12.0, 13.0, 14.0))
    rate = jdp.run.records.Throughput(0)
    assert rate.first_step(None) == 10.0
    assert rate(5) == 2.0  # steps 2..5 in the 2 s after the first one
    assert rate(9) == 4.0  # steps 6..9 in the 1 s since step 5, not 4 steps in the 3 s since step 1
    assert rate(9) is None  # no step since the last call


def test_the_profile_traces_first_to_last_inclusive(monkeypatch, tmp_path):
    # the trace starts before FIRST is launched and stops after LAST has finished, marking each step between
    import contextlib

    from jdp.run.profile import StepProfile

    calls = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: calls.append("start"))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append("stop"))
    monkeypatch.setattr(jax.profiler, "StepTraceAnnotation",
                        lambda name, step_num: calls.append(step_num) or contextlib.nullcontext())
    lines = []
    profile = StepProfile((3, 5), str(tmp_path), log=lines.append)
    for s in range(1, 9):
        with profile.step(s):
            calls.append(f"run {s}")
        profile.done(s, None)
    assert calls == ["run 1", "run 2", "start", 3, "run 3", 4, "run 4", 5, "run 5", "stop", "run 6", "run 7", "run 8"]
    assert [line.split(" written")[0] for line in lines] == ["profile of steps 3..5"]


def test_the_wandb_run_is_offline_and_named_by_the_config_hash(monkeypatch, tmp_path):
    # the run's W&B id is its config hash's first 16 hex digits, so a resumed run syncs into the same W&B run
    from types import SimpleNamespace

    import jdp.extras
    from jdp.run.trackers import WandbOffline

    seen = {}
    logged = []
    fake = SimpleNamespace(Settings=lambda **k: k,
                           init=lambda **k: seen.update(k) or SimpleNamespace(log=lambda v, step: logged.append((step, v)),
                                                                              finish=lambda: None))
    monkeypatch.setattr(jdp.extras, "require", lambda *a: fake)
    monkeypatch.setenv("WANDB_SILENT", "true")
    config_hash = "0123456789abcdef" + "f" * 48
    tracker = WandbOffline(str(tmp_path), name="w", config={"train": {"steps": 6}}, config_hash=config_hash,
                           devices=2)
    assert (seen["id"], seen["resume"], seen["mode"], seen["project"], seen["name"]) == (
        "0123456789abcdef", "allow", "offline", "jdp", "w")
    assert seen["config"] == {"train": {"steps": 6}, "jdp": {"config_hash": config_hash, "devices": 2,
                                                           "workdir": str(tmp_path)}}
    tracker.write({"step": 4, "loss": 1.5})
    assert logged == [(4, {"loss": 1.5})]
