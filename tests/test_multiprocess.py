"""Real jax.distributed processes on 127.0.0.1: equality with one process, preemption, a dying peer.

Every subprocess has a timeout, so a failure can never hang the suite.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks.common import child_env
from jdp.run.checkpoint import latest_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One xdist worker runs this file: one `one_process` run, and one multi-process job at a time.
pytestmark = pytest.mark.xdist_group("test_multiprocess")
ENV = child_env()
COMMON = ["--set", "data.batch_size=64", "--log-every", "1", "--no-progress"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jdp_train(*args):
    return [sys.executable, "-m", "jdp.run.cli", "train", *args, *COMMON]


def launch(workdir, steps, processes=2, devices=2, extra=()):
    port = free_port()
    return [subprocess.Popen(jdp_train("--workdir", str(workdir), "--steps", str(steps), "--devices", str(devices),
                                       "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
                                       "--process-id", str(i), "--init-timeout", "30", *extra),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
            for i in range(processes)]


def finish(procs, timeout=240):
    """(returncode, stdout, stderr) of each process; on a timeout every process is killed."""
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


def trainer_pid(supervisor):
    """The training process a multi-process `jdp train` runs under its supervisor."""
    deadline = time.monotonic() + 120  # a hang guard: a loaded machine starts processes slowly
    while time.monotonic() < deadline:
        found = subprocess.run(["pgrep", "-P", str(supervisor.pid)], capture_output=True, text=True).stdout.split()
        if found:
            return int(found[0])
        time.sleep(0.1)
    raise AssertionError("the supervisor started no training process")


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def flat(tree):
    if isinstance(tree, dict):
        return [x for k in sorted(tree) for x in flat(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in flat(v)]
    return [np.asarray(tree)]


def assert_same_run(work, reference, steps=6):
    """The run in `work` logged the losses of the run in `reference` and checkpointed its params (same shapes)."""
    np.testing.assert_allclose(list(losses(work).values()), list(losses(reference).values()), rtol=1e-6)
    (s_work, p_work), (s_ref, p_ref) = latest_params(work), latest_params(reference)
    assert s_work == s_ref == steps
    for a, b in zip(flat(p_work), flat(p_ref)):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=2e-6)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The multi-process runs' config trained here, in one process on 4 of its devices (the CLI's
    `--devices 4` run: the same program, one process start fewer for every test that uses it)."""
    import jax

    from jdp.config import load_config
    from jdp.train import train

    work = tmp_path_factory.mktemp("single")
    train(load_config(None, ["data.batch_size=64", "train.log_every=1", "train.steps=6"]), str(work),
          devices=jax.devices()[:4], log=lambda *_: None, progress=False)
    return work


def test_two_processes_equal_one(tmp_path, one_process):
    work = tmp_path / "multi"
    for code, out, err in finish(launch(work, 6)):
        assert code == 0, err[-2000:]
    assert_same_run(work, one_process)


def test_one_process_on_four_devices_equals_one_device(tmp_path, one_process):
    # With the test above (two processes equal this one), two processes equal one device.
    one_device = tmp_path / "one_device"
    r = subprocess.run(jdp_train("--workdir", str(one_device), "--steps", "6", "--devices", "1"), capture_output=True,
                       text=True, env=ENV, cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(list(losses(one_process).values()), list(losses(one_device).values()), rtol=1e-5)


def test_two_processes_with_the_optimizer_state_sharded_equal_one(tmp_path, one_process):
    # Each of the 4 devices (2 per process) keeps a quarter of Adam's moments; the checkpoint is
    # gathered back to the params' shapes, the same as a replicated run's.
    work = tmp_path / "zero"
    for code, out, err in finish(launch(work, 6, extra=["--set", "parallel.shard_optimizer_state=true"])):
        assert code == 0, err[-2000:]
    assert_same_run(work, one_process)


def test_two_processes_with_params_sharded_equal_one(tmp_path, one_process):
    # FSDP through the CLI: each of the 4 devices (2 per process) keeps a quarter of every params
    # leaf and of Adam's moments; the checkpoint holds the params whole, as a replicated run's.
    work = tmp_path / "fsdp"
    for code, out, err in finish(launch(work, 6, extra=["--set", "parallel.shard_params=true"])):
        assert code == 0, err[-2000:]
    assert_same_run(work, one_process)


def test_hybrid_sharding_two_hosts_of_four_devices_equals_one(tmp_path, one_process):
    # parallel.replicas=hosts: each process's 4 devices split every params leaf and Adam's moments in
    # quarters, the 2 processes hold one copy each, and each gradient block crosses between them in
    # one all-reduce; the checkpoint holds the params whole, as a replicated run's.
    work = tmp_path / "hybrid"
    results = finish(launch(work, 6, devices=4, extra=["--set", "parallel.shard_params=true",
                                                       "--set", "parallel.replicas=hosts"]))
    for code, out, err in results:
        assert code == 0, err[-2000:]
    assert "sharded over 4 devices in each of 2 replica groups" in results[0][1]
    assert_same_run(work, one_process)


def test_sigterm_on_one_process_stops_all_at_one_step_and_resumes(tmp_path):
    work = tmp_path / "pre"
    procs = launch(work, 2000)
    deadline = time.monotonic() + 120
    while not os.path.exists(work / "metrics.jsonl") or len(losses(work)) < 3:  # mid-training
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)  # to one process only; its supervisor forwards it
    results = finish(procs)
    assert [code for code, _, _ in results] == [0, 0], [err[-1500:] for _, _, err in results]
    assert "checkpoint saved" in results[0][1]
    stopped, _ = latest_params(work)
    assert 3 <= stopped < 2000
    # Resume both processes for 5 more steps; compare with one process run straight to that step.
    assert all(code == 0 for code, _, _ in finish(launch(work, 2000, extra=["--stop-after", "5"])))
    straight = tmp_path / "straight"
    r = subprocess.run(jdp_train("--workdir", str(straight), "--steps", "2000", "--devices", "4", "--stop-after",
                                 str(stopped + 5)), capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stderr
    assert sorted(losses(work)) == list(range(1, stopped + 6))
    np.testing.assert_allclose([losses(work)[k] for k in sorted(losses(work))],
                               [losses(straight)[k] for k in sorted(losses(work))], rtol=1e-6)
    (s1, p1), (s2, p2) = latest_params(work), latest_params(straight)
    assert s1 == s2 == stopped + 5
    for a, b in zip(flat(p1), flat(p2)):
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_a_killed_peer_stops_the_survivor_within_60_s(tmp_path):
    procs = launch(tmp_path / "kill", 100000, extra=["--set", "train.steps=100000"])
    deadline = time.monotonic() + 120
    while not os.path.exists(tmp_path / "kill" / "metrics.jsonl") or len(losses(tmp_path / "kill")) < 2:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.2)
    os.kill(trainer_pid(procs[1]), signal.SIGKILL)  # the training process itself, as an OOM killer would
    killed_at = time.monotonic()
    (code, _, err), _ = finish(procs, timeout=90)
    waited = time.monotonic() - killed_at
    assert code == 1 and waited < 60, (code, waited)
    assert "jdp: error: process 0 stopped (SIGABRT) because process 1 stopped responding" in err, err[-1500:]


def test_a_stalled_peer_is_named_with_the_heartbeat_timeout(tmp_path):
    # SIGSTOP: the peer is alive but silent; the survivor must say which one, that it may only be
    # stalled, and the timeout it waited (here set to 5 s) with the flag that changes it.
    work = tmp_path / "stall"
    procs = launch(work, 100000, extra=["--set", "train.steps=100000", "--heartbeat-timeout", "5"])
    stalled = None
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(work / "metrics.jsonl") or len(losses(work)) < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        stalled = trainer_pid(procs[1])
        os.kill(stalled, signal.SIGSTOP)
        _, err = procs[0].communicate(timeout=90)
    finally:
        if stalled is not None:
            os.kill(stalled, signal.SIGKILL)
        finish(procs, timeout=30)
    assert procs[0].returncode == 1, err[-1500:]
    assert ("process 1 stopped responding (it may be stalled rather than dead): no heartbeat reached the "
            "coordinator for --heartbeat-timeout 5 s") in err, err[-1500:]


def test_unreachable_coordinator_is_a_clear_error():
    port = free_port()
    r = subprocess.run(jdp_train("--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1",
                                 "--steps", "2", "--init-timeout", "3"), capture_output=True, text=True, env=ENV,
                       cwd=ROOT, timeout=240)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"the coordinator 127.0.0.1:{port} is unreachable after 3 s" in r.stderr


def test_processes_that_disagree_stop_naming_the_difference(tmp_path):
    # Another seed and learning rate: both named as fields, with each process's value, not as digests.
    port = free_port()
    procs = [subprocess.Popen(jdp_train("--workdir", str(tmp_path / "d"), "--steps", "4", "--devices", "2",
                                        "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                        "--process-id", str(i), "--set", f"optim.lr={lr}", "--set", f"train.seed={seed}"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
             for i, (lr, seed) in enumerate((("0.003", "0"), ("0.001", "1")))]
    results = finish(procs, timeout=120)
    for code, _, err in results:
        assert code == 2 and "Traceback" not in err, err[-1500:]
        assert ("processes disagree about the run (optim.lr: process 0 0.003, process 1 0.001; train.seed: process 0 "
                "0, process 1 1); start them all") in err, err[-1500:]


def test_processes_reading_different_data_behind_one_path_are_refused_before_any_step(tmp_path):
    # Each "host" has its own copy of train.bin (its own working directory): same size, other tokens.
    tiny = ["model.name=gpt", "data.name=tokens", "data.vocab_size=64", "model.d_model=16", "model.n_heads=2",
            "model.n_layers=1", "model.context=8", "data.batch_size=16", "data.path=train.bin"]
    port, work = free_port(), tmp_path / "w"
    env = {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, ENV.get("PYTHONPATH")]))}
    procs = []
    for i in range(2):
        host = tmp_path / f"host{i}"
        host.mkdir()
        np.random.default_rng(i).integers(0, 64, 5000).astype(np.uint16).tofile(host / "train.bin")
        procs.append(subprocess.Popen(
            jdp_train("--workdir", str(work), "--steps", "4", "--devices", "2", "--coordinator", f"127.0.0.1:{port}",
                      "--num-processes", "2", "--process-id", str(i), "--init-timeout", "30",
                      *[x for o in tiny for x in ("--set", o)]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=host))
    for code, _, err in finish(procs, timeout=120):
        assert code == 2 and "Traceback" not in err, err[-1500:]
        assert ("the training data's digest (read from 'train.bin'): process 0 'b08afc2444de9c70', process 1 "
                "'c5a028712627e0cb')") in err, err  # the digests docs/reliability.md shows
    assert not os.path.exists(work / "metrics.jsonl") and not os.path.exists(work / "checkpoints")


def test_a_process_id_given_twice_is_named_without_a_stack_dump(tmp_path):
    port, work = free_port(), tmp_path / "w"
    procs = []
    for i in (0, 1, 1):  # the second process 1 was meant to be process 2
        procs.append(subprocess.Popen(jdp_train("--workdir", str(work), "--steps", "2", "--devices", "1",
                                                "--coordinator", f"127.0.0.1:{port}", "--num-processes", "3",
                                                "--process-id", str(i), "--init-timeout", "10"),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT))
        time.sleep(1.0)  # the first process 1 registers before the second
    results = finish(procs, timeout=120)
    for code, _, err in results:
        assert code == 1 and "Check failure stack trace" not in err and "@     0x" not in err, err[-1500:]
        assert err.count("jdp: error:") == 1 and "Traceback" not in err, err[-1500:]
    refused = [err for _, _, err in results if "another process joined with the same --process-id 1" in err]
    assert len(refused) == 1, [err[-600:] for _, _, err in results]
    assert "start each --process-id from 0 to 2 exactly once" in refused[0]
    others = [err for _, _, err in results if err not in refused]
    assert all("not every process joined within --init-timeout 10 s" in err for err in others), others
    logs = sorted(os.listdir(work))
    assert len([n for n in logs if n.startswith("jdp-process-")]) == 3, logs
    for name in logs:
        with open(work / name) as f:
            assert "Check failure stack trace" in f.read()


def test_processes_with_another_schedule_or_device_count_are_refused_before_any_step(tmp_path):
    # A different --checkpoint-every would deadlock at the first checkpoint (one process enters
    # orbax's collective save, the other the next step); a different --devices would fail in a
    # reshape. Both are named, with every process's value, before anything is trained.
    port = free_port()
    procs = [subprocess.Popen(jdp_train("--workdir", str(tmp_path / "s"), "--steps", "4", "--devices", devices,
                                        "--checkpoint-every", every, "--coordinator", f"127.0.0.1:{port}",
                                        "--num-processes", "2", "--process-id", str(i), "--init-timeout", "30"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
             for i, (devices, every) in enumerate((("2", "2"), ("4", "3")))]
    for code, _, err in finish(procs, timeout=120):
        assert code == 2 and "Traceback" not in err, err[-1500:]
        assert "local devices: process 0 2, process 1 4" in err, err[-1500:]
        assert "train.checkpoint_every: process 0 2, process 1 3" in err, err[-1500:]
    assert not os.path.exists(tmp_path / "s" / "metrics.jsonl")


def test_sigint_on_a_single_process_run_checkpoints_and_exits_130(tmp_path):
    # Ctrl-C during training: the step it stops at is checkpointed, and the exit code says it was
    # interrupted (130, as a shell reports Ctrl-C); SIGTERM (a scheduler's preemption) exits 0.
    work = tmp_path / "int"
    proc = subprocess.Popen(jdp_train("--workdir", str(work), "--steps", "2000", "--devices", "2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    deadline = time.monotonic() + 120
    while not os.path.exists(work / "metrics.jsonl") or len(losses(work)) < 3:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    ((code, out, err),) = finish([proc])
    assert code == 130 and "stopping at step" in out and "SIGINT" in out and "Traceback" not in err, err[-1500:]
    stopped, _ = latest_params(work)
    assert stopped == max(losses(work))


def test_sigterms_during_the_teardown_after_a_preemption_checkpoint_exit_0(tmp_path):
    # A scheduler repeats SIGTERM until the job ends: once "checkpoint saved" is printed the job has
    # succeeded, so every later signal must end it with exit code 0, not -15.
    import threading

    work = tmp_path / "teardown"
    proc = subprocess.Popen(jdp_train("--workdir", str(work), "--steps", "2000", "--devices", "2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**ENV, "PYTHONUNBUFFERED": "1"})
    saved = threading.Event()
    reader = threading.Thread(target=lambda: [saved.set() for line in proc.stdout if "checkpoint saved" in line],
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(work / "metrics.jsonl") or len(losses(work)) < 3:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert saved.wait(240), "no 'checkpoint saved' line"
        while proc.poll() is None:  # again and again, through the whole teardown
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.002)
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        reader.join(timeout=10)
        err = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    assert code == 0, err[-1500:]
