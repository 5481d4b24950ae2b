"""Data that changes or turns out bad under a run, and a disk that fills, met as a user meets them:
`jdp train` in a real process, real token files truncated while it trains, a real tmpfs filled up.

The cheap halves (a changed file, a too-narrow dtype, another model's checkpoint, the words of a
full disk, the supervisor's sentence for a --process-id given twice) run in the quick tier; each
process here has a hard timeout.
"""
import errno
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import jdp
from benchmarks.common import child_env
from jdp.data import load_tokens, make_batches
from jdp.data.tokens import SAMPLE_BLOCKS, SAMPLE_TOKENS, TokenFileChangedError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_env()
TINY = ["model.name=gpt", "data.name=tokens", "data.vocab_size=64", "model.d_model=16", "model.n_heads=2",
        "model.n_layers=1", "model.context=8", "model.dropout=0.0", "data.batch_size=16", "optim.name=sgd",
        "optim.lr=0.3"]


def jdp_train(workdir, path, *args, extra=()):
    sets = [x for o in [*TINY, f"data.path={path}", *extra] for x in ("--set", o)]
    return [sys.executable, "-m", "jdp.run.cli", "train", "--workdir", str(workdir), "--no-progress", "--log-every",
            "1", "--devices", "2", *sets, *args]


def steps_logged(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return f.read().count("\n")


def checkpoints(workdir):
    return sorted(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit())


def test_a_token_file_truncated_during_a_run_is_one_sentence_with_its_sizes_and_the_steps_saved(tmp_path):
    path = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, 64, 400_000).astype(np.uint16).tofile(path)
    work = tmp_path / "w"
    p = subprocess.Popen(jdp_train(work, path, "--steps", "100000", "--checkpoint-every", "1000"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    try:
        deadline = time.monotonic() + 180
        while steps_logged(work) < 6 and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.truncate(path, 20_000)  # the tokenizer run again, writing a smaller file in place
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 1 and err.count("\n") == 1 and "Traceback" not in err, err[-2000:]  # not SIGBUS (-7)
    assert f"token file '{path}' changed while the run read it: it held 800000 bytes when opened and holds 20000 now" \
        in err, err
    stopped = int(err.split("training stopped before step ")[1].split(",")[0])
    assert f"the {stopped - 1} steps before it are saved in checkpoint {stopped - 1}" in err, err
    assert checkpoints(work) == [stopped - 1] and stopped - 1 >= 6


def bad_id_in_step(path, n, step, vocab=64):
    """A token file of n ids below `vocab` but for one id 999 that only the batch of `step` (1-based,
    seed 0, 16 windows of 8) reads: outside the blocks sampled when the file is opened, and outside
    the earlier steps' windows. Found with a uint32 probe file whose ids are their positions."""
    probe = path.with_suffix(".probe")
    np.arange(n, dtype=np.uint32).tofile(probe)
    it = make_batches(load_tokens(probe, context_length=8, dtype="uint32"), 16, seed=0, prefetch=0)
    starts = [next(it)["x"][:, 0] for _ in range(step)]
    sampled = np.linspace(0, n - SAMPLE_TOKENS, SAMPLE_BLOCKS).astype(int)
    earlier = {int(s) + k for batch in starts[:-1] for s in batch for k in range(9)}
    position = next(int(s) + 3 for s in starts[-1]
                    if int(s) + 3 not in earlier and not any(b <= s + 3 < b + SAMPLE_TOKENS for b in sampled))
    tokens = np.random.default_rng(0).integers(0, vocab, n).astype(np.uint16)
    tokens[position] = 999
    tokens.tofile(path)
    return position


def test_a_bad_token_id_found_late_saves_the_steps_before_it_and_exits_1(tmp_path):
    path = tmp_path / "train.bin"
    position = bad_id_in_step(path, 200_000, step=5)
    work = tmp_path / "w"
    r = subprocess.run(jdp_train(work, path, "--steps", "6", extra=["train.checkpoint_every=0"]), capture_output=True,
                       text=True, env=ENV, cwd=ROOT, timeout=240)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert (f"training stopped before step 5, whose batch could not be read: token file '{path}' holds the token id "
            f"999 at position {position}, not below vocab_size=64") in r.stderr, r.stderr
    assert "the 4 steps before it are saved in checkpoint 4." in r.stderr, r.stderr
    assert checkpoints(work) == [4]


def test_an_unreadable_token_file_is_one_sentence_exit_2_before_anything_is_written(tmp_path):
    path = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, 64, 5000).astype(np.uint16).tofile(path)
    path.chmod(0)
    cmd = jdp_train(tmp_path / "w", path, "--steps", "2")
    if os.geteuid() == 0:  # root reads any file: drop the capabilities that let it
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: cannot make a file unreadable to this user")
        drop = "-dac_override,-dac_read_search"
        cmd = ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=240)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"jdp: error: token file '{path}' cannot be opened (Permission denied); give this user read permission" \
        in r.stderr, r.stderr
    assert not (tmp_path / "w").exists()


def test_a_token_file_that_changes_size_is_refused_at_the_next_batch(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    tokens = load_tokens(path, context_length=8, vocab_size=1000)
    tokens.take(np.array([0, 100]))
    with open(path, "ab") as f:  # grown: every window still reads, but the file is not the one opened
        f.write(np.arange(10, dtype=np.uint16).tobytes())
    with pytest.raises(TokenFileChangedError, match=r"it held 2000 bytes when opened and holds 2020 now"):
        tokens.take(np.array([0]))
    os.truncate(path, 100)  # shrunk below the windows: a memory map would die of SIGBUS here
    with pytest.raises(TokenFileChangedError, match=r"it held 2000 bytes when opened and holds 100 now"):
        tokens.take(np.array([100]))


def test_a_dtype_too_narrow_for_the_vocabulary_is_refused_naming_the_likely_one(tmp_path):
    path = tmp_path / "gpt2.bin"
    np.random.default_rng(0).integers(0, 50257, 4000).astype(np.uint16).tofile(path)  # GPT-2 ids, as nanoGPT writes
    with pytest.raises(ValueError, match=r"a uint8 token file cannot hold ids up to vocab_size - 1 = 50303 \(at most "
                                         r"255\), so the token file '.*gpt2.bin' is probably uint16"):
        load_tokens(path, context_length=8, dtype="uint8", vocab_size=50304)
    with pytest.raises(ValueError, match=r"probably uint32"):
        load_tokens(path, context_length=8, dtype="uint16", vocab_size=65537)
    assert len(load_tokens(path, context_length=8, dtype="uint8", vocab_size=256)) == 999  # 256 ids fit in uint8
    assert len(load_tokens(path, context_length=8, dtype="uint16", vocab_size=65536)) == 499


@pytest.mark.parametrize("layout", [{}, {"shard_optimizer_state": True}, {"shard_params": True}],
                         ids=["replicated", "zero1", "fsdp"])
def test_another_models_checkpoint_is_named_as_another_model_in_every_layout(tmp_path, layout):
    import jax
    import jax.numpy as jnp
    import optax

    def loss(params, batch):
        return jnp.mean((batch["x"] @ params["w"]) ** 2)

    def step():
        return jdp.make_train_step(loss, optax.adam(0.1), devices=jax.devices()[:4], **layout)

    trained = step()
    jdp.save_state(str(tmp_path), trained, trained.init({"w": jnp.ones((5, 3))}))
    other = step()
    with pytest.raises(jdp.run.checkpoint.CheckpointMismatchError) as error:
        jdp.restore_state(str(tmp_path), other, other.init({"w": jnp.ones((5, 4))}))
    assert ("holds params of another structure (checkpoint: w (5, 3); this step: w (5, 4)), so it was written with "
            "another model") in str(error.value), error.value


def test_orbax_ocdbt_resource_exhausted_without_an_os_error_is_out_of_space():
    from jdp.run.checkpoint_faults import out_of_space_code

    ocdbt = ValueError('RESOURCE_EXHAUSTED: Error writing "params.w/0" in OCDBT database at local file '
                       '"/mnt/w/checkpoints/3.orbax-checkpoint-tmp/state/ocdbt.process_0/"')
    assert out_of_space_code(ocdbt) == errno.ENOSPC
    assert out_of_space_code(ValueError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.")) is None
    assert out_of_space_code(ValueError("x [os_error_code='13']")) is None  # EACCES is not a full disk


FULL_DISK = """
set -u
mount -t tmpfs -o size=2m tmpfs "$MNT" || exit 99
run() { "$PY" -m jdp.run.cli train --workdir "$MNT/w" --no-progress --devices 2 --set data.batch_size=64 \
        --checkpoint-every 1 --set train.keep_checkpoints=9 "$@"; echo "rc=$?"; }
run --steps 2 >/dev/null 2>&1
free=$(df --output=avail -k "$MNT" | tail -1)
dd if=/dev/zero of="$MNT/filler" bs=1k count=$((free - 60)) 2>/dev/null  # 60 kB left: less than a checkpoint
echo "=== full"; run --steps 6 2>&1
rm "$MNT/filler"
echo "=== freed"; run --steps 6 2>&1
"""


def test_a_full_tmpfs_during_a_checkpoint_write_is_one_sentence_and_the_run_resumes(tmp_path):
    """A real full file system: a 2 MB tmpfs in a private mount namespace (`unshare -m`: it vanishes with
    the script, whatever happens), filled up to 60 kB after checkpoint 2."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) to mount a small tmpfs in a private mount namespace")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs '{mnt}'"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({probe.stderr.strip() or probe.returncode})")
    r = subprocess.run(["unshare", "-m", "sh", "-c", FULL_DISK], capture_output=True, text=True, cwd=ROOT,
                       timeout=400, env={**ENV, "MNT": str(mnt), "PY": sys.executable})
    full, freed = r.stdout.split("=== full\n")[1].split("=== freed\n")
    assert "rc=1" in full and "Traceback" not in full, full[-3000:]
    assert "could not be written to" in full and "(No space left on device: a full disk, a quota or the file-size " \
        "limit)" in full and "every checkpoint saved before it is intact" in full, full[-3000:]
    assert full.count("jdp: error:") == 1 and "RESOURCE_EXHAUSTED" not in full, full[-3000:]
    assert "rc=0" in freed and "done at step 6 of 6" in freed, freed[-3000:]


def test_a_bad_token_id_found_late_through_the_api_checkpoints_first(tmp_path):
    from jdp.config import load_config
    from jdp.train import DataStoppedError, train

    path = tmp_path / "train.bin"
    bad_id_in_step(path, 200_000, step=3)
    config = load_config(None, [*TINY, f"data.path={path}", "train.steps=4", "train.checkpoint_every=0",
                                "parallel.devices=2"])
    with pytest.raises(DataStoppedError, match=r"training stopped before step 3, whose batch could not be read: .*"
                                               r"the 2 steps before it are saved in checkpoint 2$"):
        train(config, str(tmp_path / "w"), log=lambda *a: None, progress=False)
    assert checkpoints(tmp_path / "w") == [2]


FATAL = """W1201 21:45:40.251122   13992 coordination_service.cc:388] a warning, shown
F1201 21:45:40.252760   13669 client.h:80] Terminating process because the JAX distributed service detected fatal \
errors. absl::Status: ALREADY_EXISTS: Aborted connect attempt as there is a request from a newer incarnation.

RPC: /xla.coordination.CoordinationService/RegisterTask
*** Check failure stack trace: ***
    @     0x7f409e840634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
"""


def test_the_supervisor_hides_a_cpp_abort_and_names_a_duplicated_process_id(capsys):
    import io

    from jdp.run.supervisor import _Relay, abnormal_end

    relay = _Relay(io.StringIO(FATAL))
    relay.thread.join(timeout=5)
    assert capsys.readouterr().err == FATAL.splitlines(keepends=True)[0]  # the warning only, no stack dump
    assert "".join(relay.hidden) == "".join(FATAL.splitlines(keepends=True)[1:])
    said = abnormal_end(1, -6, "".join(relay.tail), 10, num_processes=3, init_timeout=60)
    assert said == ("process 1 was refused by the coordinator (SIGABRT): another process joined with the same "
                    "--process-id 1; every process of a job needs its own id: stop every process of this job and "
                    "start each --process-id from 0 to 2 exactly once.")
    waited = "absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded\n\nRPC: /xla.coordination.CoordinationService/RegisterTask\n"
    assert abnormal_end(0, -6, waited, 10, num_processes=3, init_timeout=60).startswith(
        "process 0 stopped (SIGABRT) because not every process joined within --init-timeout 60 s; stop every process")
