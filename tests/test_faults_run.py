"""No run is ever lost: durable final saves under signals, the step before a failing evaluation or
metrics write, and one run per workdir (a lock taken over from a killed run, released on every exit).

Most cases run `train()` in this process (a few seconds each); a fresh CLI process only where a
real second process is the point (a second run refused by the lock, a multi-process job).
"""
import errno
import json
import os
import signal
import socket
import subprocess
import sys

import jax
import orbax.checkpoint as ocp
import pytest

import jdp.run.cli
import jdp.run.train as train_module
from jdp.config import load_config
from jdp.run.lock import LOCK_NAME, WorkdirLock, WorkdirLockedError
from jdp.run.metrics import MetricsWriter
from jdp.train import train

from test_faults import ROOT, TEMPLATE_ARGS, assert_refused, run_jdp, snapshot

# The template of test_faults (the default MLP, 2 devices, batch 64): checkpoint_every=0 and
# eval_every=0 by default, so the only checkpoint is the last one, taken just before the evaluation.
SETTINGS = ["data.batch_size=64", "train.log_every=1"]


def run(workdir, steps, *extra, log=None, stop_after=None):
    cfg = load_config(None, [f"train.steps={steps}", *SETTINGS, *extra])
    return train(cfg, str(workdir), devices=jax.devices()[:2], log=log or (lambda *_: None), progress=False,
                 stop_after=stop_after)


def checkpoint_steps(workdir) -> list:
    """Complete checkpoints (orbax renames a finished write to its step) and any write in flight."""
    names = os.listdir(os.path.join(workdir, "checkpoints"))
    return sorted(int(n) for n in names if n.isdigit()) + sorted(n for n in names if "tmp" in n)


@pytest.fixture
def foreign_handlers():
    """SIGTERM/SIGINT handlers of the caller, which must never see a signal sent while jdp trains."""
    seen = []
    old = {sig: signal.signal(sig, lambda signum, frame: seen.append(signal.Signals(signum).name))
           for sig in (signal.SIGTERM, signal.SIGINT)}
    yield seen
    for sig, handler in old.items():
        signal.signal(sig, handler)


def test_signals_stay_handled_until_every_write_is_awaited(tmp_path, monkeypatch, foreign_handlers):
    real_save, real_wait = ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished

    def save(self, step, *args, **kwargs):
        done = real_save(self, step, *args, **kwargs)
        if step == 2:  # a scheduler's SIGTERM, while checkpoint 2 is being written
            os.kill(os.getpid(), signal.SIGTERM)
        return done

    def wait(self):
        # Two more signals while every write is awaited (the last save, and the final cleanup): a
        # handler restored too early would let them through to the caller's handlers (or kill a CLI).
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        real_wait(self)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", wait)
    said = []  # each message, with the checkpoints on disk as it is said
    result = run(tmp_path / "w", 6, "train.checkpoint_every=2",
                 log=lambda m: said.append((m, checkpoint_steps(tmp_path / "w"))))
    assert foreign_handlers == []
    assert result.preempted and result.steps == 3
    stop = [on_disk for m, on_disk in said if "stopping at step 3 on SIGTERM; checkpoint saved" in m]
    assert stop == [[2, 3]], said  # said only once checkpoint 3 was complete on disk
    assert checkpoint_steps(tmp_path / "w") == [2, 3]
    assert not (tmp_path / "w" / LOCK_NAME).exists()


def test_final_checkpoint_is_on_disk_before_the_final_evaluation(tmp_path, monkeypatch):
    seen = []

    def out_of_memory(*args, **kwargs):
        seen.append(checkpoint_steps(tmp_path / "w"))
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while evaluating")

    monkeypatch.setattr(train_module, "evaluate", out_of_memory)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        run(tmp_path / "w", 3)
    assert seen == [[3]]  # complete (renamed from its temporary directory) when the evaluation began
    monkeypatch.undo()
    assert not (tmp_path / "w" / LOCK_NAME).exists()  # released on the way out of the failure
    resumed = run(tmp_path / "w", 3)
    assert resumed.resumed_from == 3


def test_failed_evaluation_mid_run_checkpoints_its_step(tmp_path, monkeypatch):
    real = train_module.evaluate
    calls = []

    def fails_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while evaluating")
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "evaluate", fails_second)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        run(tmp_path / "w", 8, "train.eval_every=2")  # no periodic checkpoints: the run's only ones
    assert checkpoint_steps(tmp_path / "w") == [4]


def test_disk_full_writing_metrics_keeps_the_step_and_says_so(tmp_path, monkeypatch, capsys):
    real = MetricsWriter.write

    def disk_full_at_4(self, record):
        if record["step"] == 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "w" / "metrics.jsonl"))
        real(self, record)

    monkeypatch.setattr(MetricsWriter, "write", disk_full_at_4)
    code = jdp.run.cli.main(["train", "--devices", "2", "--steps", "6", "--set", "data.batch_size=64", "--workdir",
                         str(tmp_path / "w"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("jdp: error: the disk is full (No space left on device writing ") and err.endswith(
        "every checkpoint already saved is intact: free some space and rerun the same command to resume.\n"), err
    assert checkpoint_steps(tmp_path / "w") == [4]
    assert not (tmp_path / "w" / LOCK_NAME).exists()


def test_lock_names_its_holder_and_refuses_a_second_holder(tmp_path):
    first, second = WorkdirLock(str(tmp_path / "new" / "w")), WorkdirLock(str(tmp_path / "new" / "w"))
    assert first.acquire() is None  # creates the workdir; nothing stale to take over
    with pytest.raises(WorkdirLockedError, match=rf"is in use by another run \(pid {os.getpid()} on "
                                                 rf"'{socket.gethostname()}', started 20"):
        second.acquire()  # flock: two descriptors conflict even within one process
    first.release()
    assert not os.path.exists(first.path)
    assert second.acquire() is None
    second.release()


def test_lock_released_between_open_and_flock_is_taken_again_on_the_current_file(tmp_path, monkeypatch):
    holder, racer, third = (WorkdirLock(str(tmp_path)) for _ in range(3))
    holder.acquire()
    real_open = os.open

    def release_right_after_open(*args, **kwargs):  # the holder ends between the racer's open and flock
        fd = real_open(*args, **kwargs)
        if holder.held:
            holder.release()
        return fd

    monkeypatch.setattr("jdp.run.lock.os.open", release_right_after_open)
    racer.acquire()
    monkeypatch.undo()
    with pytest.raises(WorkdirLockedError):  # the racer holds the file at the path, not an unlinked one
        third.acquire()
    racer.release()


def test_stale_lock_of_a_killed_run_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from jdp.run.lock import WorkdirLock; "
                               "WorkdirLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(600)",
                               str(tmp_path / "w")], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(WorkdirLockedError):
            WorkdirLock(str(tmp_path / "w")).acquire()
    finally:
        holder.kill()  # SIGKILL: no chance to release; the kernel drops the flock
        holder.wait(timeout=30)
        holder.stdout.close()
    assert (tmp_path / "w" / LOCK_NAME).exists()
    said = []
    assert run(tmp_path / "w", 2, log=said.append).steps == 2
    assert any(f"took over the lock of an earlier run on this workdir (pid {holder.pid} on " in s for s in said)
    assert not (tmp_path / "w" / LOCK_NAME).exists()


@pytest.fixture
def held_run(tmp_path):
    """A workdir holding a 2-step run (the template's), locked by this process as a live run would."""
    run(tmp_path / "w", 2)
    lock = WorkdirLock(str(tmp_path / "w"))
    lock.acquire()
    yield tmp_path / "w"
    lock.release()


def test_second_run_on_a_held_workdir_is_refused_and_changes_nothing(held_run):
    before = snapshot(held_run)
    r = run_jdp("train", *TEMPLATE_ARGS, "--steps", "4", "--workdir", str(held_run), "--no-progress")
    assert_refused(r, f"jdp: error: --workdir '{held_run}' is in use by another run (pid {os.getpid()} on "
                      f"'{socket.gethostname()}', started ",
                   "); wait for it to end or stop it, or use another --workdir.")
    assert snapshot(held_run) == before


def test_second_multi_process_job_on_a_held_workdir_is_refused_on_every_process(held_run):
    from test_multiprocess import finish, launch

    before = snapshot(held_run)
    for code, out, err in finish(launch(held_run, 4), timeout=120):
        assert code == 2 and "Traceback" not in err, err[-2000:]
        assert f"is in use by another run (pid {os.getpid()} on " in err, err[-2000:]
    assert snapshot(held_run) == before


def test_plot_into_a_missing_directory_is_one_sentence(tmp_path, capsys):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    before = snapshot(tmp_path)
    out = str(tmp_path / "missing" / "curves.png")
    assert jdp.run.cli.main(["plot", str(tmp_path / "w"), "--out", out]) == 2
    err = capsys.readouterr().err
    assert err == (f"jdp: error: --out {out!r} is in a directory that does not exist ("
                   f"{str(tmp_path / 'missing')!r}); create it or choose another path.\n")
    assert snapshot(tmp_path) == before


def test_out_of_memory_evaluation_mid_run_keeps_the_steps_record_and_ends_in_one_sentence(tmp_path, monkeypatch,
                                                                                          capsys):
    real, calls = train_module.evaluate, []

    def fails_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.")
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "evaluate", fails_second)
    argv = ["train", "--devices", "2", "--steps", "6", "--set", "data.batch_size=64", "--set", "train.eval_every=2",
            "--log-every", "1", "--workdir", str(tmp_path / "w"), "--no-progress"]
    code = jdp.run.cli.main(argv)
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert err == ("jdp: error: the evaluation after step 4 ran out of memory (RESOURCE_EXHAUSTED: Out of memory "
                   "while trying to allocate 1.00GiB.); lower data.eval_batch_size (now 256) and rerun the same "
                   "command, which resumes from the newest checkpoint.\n")
    assert checkpoint_steps(tmp_path / "w") == [4]
    with open(tmp_path / "w" / "metrics.jsonl") as f:
        assert [r["step"] for r in map(json.loads, f) if "loss" in r] == [1, 2, 3, 4]  # step 4's record too
    monkeypatch.undo()
    assert jdp.run.cli.main(argv) == 0
    with open(tmp_path / "w" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 6]


def test_a_checkpoint_write_past_the_file_size_limit_is_one_sentence_and_resumes(tmp_path):
    # RLIMIT_FSIZE makes every write past 20 kB fail with EFBIG, as a full disk fails with ENOSPC:
    # the metrics lines fit, the first checkpoint (step 2, ~115 kB of arrays) does not.
    work = tmp_path / "w"
    argv = [sys.executable, "-m", "jdp.run.cli", "train", "--devices", "2", "--steps", "4", "--checkpoint-every", "2",
            "--set", "data.batch_size=64", "--workdir", str(work), "--no-progress"]
    limited = [sys.executable, "-c", "import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (20000, "
               "20000)); os.execv(sys.argv[1], sys.argv[1:])", *argv]  # no fork of this (threaded) process
    uncached = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}  # cut entries: corrupt
    r = subprocess.run(limited, capture_output=True, text=True, cwd=ROOT, timeout=240, env=uncached)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert r.stderr.startswith(f"jdp: error: checkpoint 2 could not be written to '{work}/checkpoints' (File too "
                               f"large: a full disk, a quota or the file-size limit); it needs about 0.1 MB of free "
                               f"space"), r.stderr
    assert "every checkpoint saved before it is intact" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert r.returncode == 0 and "done at step 4 of 4" in r.stdout, r.stderr[-3000:]


def test_the_failed_saves_other_write_tasks_print_nothing_at_exit(caplog):
    """Orbax's other write tasks of a save that ran out of space fail alike; asyncio logs each one's
    traceback when it is collected, at exit or before, by timing (seen once in 4 full runs). Once the
    CLI has reported the save, those records are dropped; any other asyncio error still prints."""
    import asyncio
    import gc
    import logging

    async def failing_write():
        raise ValueError("OUT_OF_RANGE: Failed to write 6479 bytes to file 7: File too large")

    def collect_one_failed_task():
        loop = asyncio.new_event_loop()
        task = loop.create_task(failing_write())
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
        del task
        gc.collect()

    def collect_one_failed_gather():  # the gather over the writes fails too, and nothing reads its exception
        loop = asyncio.new_event_loop()

        async def start():
            return asyncio.gather(failing_write(), failing_write())

        gathered = loop.run_until_complete(start())
        loop.run_until_complete(asyncio.sleep(0.01))
        loop.close()
        del gathered
        gc.collect()

    asyncio_log, before = logging.getLogger("asyncio"), list(logging.getLogger("asyncio").filters)
    try:
        collect_one_failed_task()
        collect_one_failed_gather()
        assert [r.getMessage().split("\n")[0] for r in caplog.records] == [
            "Task exception was never retrieved", "_GatheringFuture exception was never retrieved"]
        caplog.clear()
        jdp.run.cli._quiet_failed_save_tasks()
        collect_one_failed_task()
        collect_one_failed_gather()
        asyncio_log.error("another asyncio error")
        assert [r.getMessage() for r in caplog.records] == ["another asyncio error"]
    finally:
        asyncio_log.filters[:] = before


def test_a_run_that_fails_before_its_first_step_leaves_no_workdir(tmp_path):
    """The first step fails as it is traced (here the loss raises): a workdir the run made is removed with
    the empty files it made there (checkpoints/, metrics.jsonl); one that existed keeps what it held."""
    import dataclasses

    from jdp.run.tasks import build_task

    cfg = load_config(None, ["train.steps=2", *SETTINGS])
    task = build_task(cfg)

    def failing(*args):
        raise ValueError("this loss refuses every batch")

    broken = dataclasses.replace(task, loss_fn=failing)
    for workdir in (tmp_path / "new", tmp_path / "deep" / "new"):
        with pytest.raises(ValueError, match="this loss refuses every batch"):
            train(cfg, str(workdir), devices=jax.devices()[:2], log=lambda *_: None, progress=False, task=broken)
        assert not workdir.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="this loss refuses every batch"):
        train(cfg, str(kept), devices=jax.devices()[:2], log=lambda *_: None, progress=False, task=broken)
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
    # a run refused by the lock takes back nothing, not even the empty files the live run made meanwhile
    held = tmp_path / "held"
    holder = WorkdirLock(str(held))
    holder.acquire()
    real = train_module.locked_workdir

    def live_run_writes_first(workdir, log):
        (held / "metrics.jsonl").touch()
        (held / "checkpoints").mkdir()
        return real(workdir, log)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(train_module, "locked_workdir", live_run_writes_first)
            with pytest.raises(WorkdirLockedError):
                train(cfg, str(held), devices=jax.devices()[:2], log=lambda *_: None, progress=False, task=broken)
        assert sorted(p.name for p in held.iterdir()) == sorted([LOCK_NAME, "checkpoints", "metrics.jsonl"])
    finally:
        holder.release()
