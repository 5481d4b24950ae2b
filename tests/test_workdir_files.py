"""Nothing outside the workdir, ever: real symlinks left in a workdir, and a victim outside it whose
bytes must be the same after the run; rotation deletes only checkpoints jdp provably wrote."""
import os

import pytest

from jdp.config import load_config
from jdp.run.metrics import plot_metrics
from jdp.train import train
from jdp.run.workfiles import DELETING, SymlinkRefusedError, is_jdp_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRECIOUS = b"someone else's data\n"


def seed_config(*overrides):
    return load_config(os.path.join(ROOT, "configs", "seed_linear.yaml"), ["train.steps=2", *overrides])


def quiet_train(cfg, workdir, **kw):
    return train(cfg, str(workdir), log=lambda *_: None, progress=False, **kw)


def snapshot(path):
    """Every file below `path` (or `path` itself) with its bytes."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, n) for d, _, ns in os.walk(path) for n in ns]
    out = {}
    for full in files:
        with open(full, "rb") as f:
            out[os.path.relpath(full, path)] = f.read()
    return out


@pytest.fixture
def victim_file(tmp_path):
    path = tmp_path / "outside" / "precious.txt"
    path.parent.mkdir()
    path.write_bytes(PRECIOUS)
    return path


@pytest.fixture
def victim_dir(tmp_path):
    folder = tmp_path / "outside_dir"
    (folder / "1").mkdir(parents=True)  # a step-like name, as orbax's rotation would take it
    (folder / "1" / "notes.txt").write_bytes(PRECIOUS)
    (folder / "notes.txt").write_bytes(PRECIOUS)
    return folder


@pytest.mark.parametrize("name, what", [(".jdp-lock", "the lock file"), ("metrics.jsonl", "the metrics file")])
def test_a_symlinked_file_in_the_workdir_is_refused_and_its_target_untouched(tmp_path, victim_file, name, what):
    work = tmp_path / "work"
    work.mkdir()
    os.symlink(victim_file, work / name)
    with pytest.raises(SymlinkRefusedError, match=f"{what} .*{name}' is a symlink .*that jdp did not create"):
        quiet_train(seed_config(), work)
    assert victim_file.read_bytes() == PRECIOUS
    assert os.path.islink(work / name)  # not replaced, not removed


def test_a_dangling_symlinked_lock_file_creates_nothing_outside(tmp_path):
    work, target = tmp_path / "work", tmp_path / "outside" / "created-by-jdp"
    work.mkdir()
    target.parent.mkdir()
    os.symlink(target, work / ".jdp-lock")
    with pytest.raises(SymlinkRefusedError, match="the lock file"):
        quiet_train(seed_config(), work)
    assert not os.path.lexists(target)


def test_a_symlinked_checkpoint_directory_is_refused(tmp_path, victim_dir):
    work = tmp_path / "work"
    work.mkdir()
    before = snapshot(victim_dir)
    os.symlink(victim_dir, work / "checkpoints")
    with pytest.raises(SymlinkRefusedError, match="the checkpoint directory .*checkpoints' is a symlink"):
        quiet_train(seed_config("train.keep_checkpoints=1", "train.checkpoint_every=1"), work)
    assert snapshot(victim_dir) == before and sorted(os.listdir(victim_dir)) == ["1", "notes.txt"]


def test_a_symlink_inside_the_checkpoint_directory_is_refused(tmp_path, victim_dir):
    work = tmp_path / "work"
    (work / "checkpoints").mkdir(parents=True)
    before = snapshot(victim_dir)
    os.symlink(victim_dir / "1", work / "checkpoints" / "1")
    with pytest.raises(SymlinkRefusedError, match="checkpoint directory entry .*checkpoints/1' is a symlink"):
        quiet_train(seed_config("train.keep_checkpoints=1", "train.checkpoint_every=1"), work)
    assert snapshot(victim_dir) == before


def test_rotation_deletes_only_checkpoints_jdp_provably_wrote(tmp_path):
    # Checkpoint 1 is replaced by someone else's directory of the same name (orbax lists it as a
    # step: any directory named by an integer). Rotation to one kept checkpoint must spare it.
    work = tmp_path / "work"
    quiet_train(seed_config("train.checkpoint_every=1", "train.keep_checkpoints=5"), work)
    ckpt = work / "checkpoints"
    assert sorted(os.listdir(ckpt)) == ["1", "2"]
    os.rename(ckpt / "1", tmp_path / "jdp-1")
    (ckpt / "1").mkdir()
    (ckpt / "1" / "notes.txt").write_bytes(PRECIOUS)
    (ckpt / f"{DELETING}7").mkdir()  # what a kill during an earlier deletion leaves: finished now
    (ckpt / f"{DELETING}7" / "x").write_bytes(b"")
    quiet_train(seed_config("train.steps=4", "train.checkpoint_every=1", "train.keep_checkpoints=1"), work)
    assert sorted(os.listdir(ckpt)) == ["1", "4"]
    assert (ckpt / "1" / "notes.txt").read_bytes() == PRECIOUS


@pytest.mark.parametrize("linked", [None, "_CHECKPOINT_METADATA", "meta", "meta/metadata"])
def test_a_checkpoint_is_proven_jdps_only_without_following_a_link(tmp_path, linked):
    # orbax's commit record and jdp's metadata, as a save leaves them; one of them (or the meta
    # directory) moved outside and linked back in proves nothing, and the directory is spared.
    ckpt, outside = tmp_path / "checkpoints" / "3", tmp_path / "outside"
    (ckpt / "meta").mkdir(parents=True)
    (ckpt / "_CHECKPOINT_METADATA").write_text('{"commit_timestamp_nsecs": 1}')
    (ckpt / "meta" / "metadata").write_text('{"checksums": {}, "run": {}}')
    if linked:
        outside.mkdir()
        os.rename(ckpt / linked, outside / "moved")
        os.symlink(outside / "moved", ckpt / linked)
    assert is_jdp_checkpoint(str(ckpt)) is (linked is None)


def test_the_default_plot_is_not_written_through_a_symlink(tmp_path, victim_file):
    work = tmp_path / "work"
    work.mkdir()
    (work / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    os.symlink(victim_file, work / "curves.png")
    with pytest.raises(SymlinkRefusedError, match="the plot"):
        plot_metrics(str(work))
    assert victim_file.read_bytes() == PRECIOUS


def test_a_workdir_that_is_itself_a_symlink_still_works(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    os.symlink(target, tmp_path / "link")
    result = quiet_train(seed_config("train.checkpoint_every=1", "train.keep_checkpoints=1"), tmp_path / "link")
    assert result.steps == 2 and sorted(os.listdir(target / "checkpoints")) == ["2"]


def test_an_empty_workdir_is_refused():
    with pytest.raises(ValueError, match="--workdir '' is empty"):
        quiet_train(seed_config(), "")


def test_a_symlinked_tensorboard_directory_is_refused(tmp_path, victim_dir):
    pytest.importorskip("tensorboardX")
    from jdp.run.metrics import MetricsWriter

    work = tmp_path / "work"
    work.mkdir()
    before = snapshot(victim_dir)
    os.symlink(victim_dir, work / "tensorboard")
    with pytest.raises(SymlinkRefusedError, match="the TensorBoard directory .*tensorboard' is a symlink"):
        MetricsWriter(str(work), total=2, start=0, log=lambda *_: None, progress=False, tensorboard=True)
    assert snapshot(victim_dir) == before and not os.path.exists(work / "metrics.jsonl")
