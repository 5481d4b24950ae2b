"""What ships inside the package: the configs, addressable by name and listed with their expected
results (`jdp configs`), and the token tool (`jdp data prepare-tokens`)."""
import glob
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.common import child_env
from jdp.data import load_char_corpus
from jdp.run.cli import main
from jdp.run.sections import ConfigError
from jdp.run.shipped import CONFIG_DIR, resolve_config, shipped_config, shipped_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(glob.glob(os.path.join(ROOT, "jdp", "configs", "*.yaml")))


def test_the_configs_ship_inside_the_package_and_the_checkout_links_to_them():
    assert os.path.samefile(CONFIG_DIR, os.path.join(ROOT, "jdp", "configs")) and len(FILES) >= 9
    assert os.path.samefile(os.path.join(ROOT, "configs"), CONFIG_DIR)  # `configs/NAME.yaml` paths of a checkout


def test_jdp_configs_lists_each_shipped_config_with_its_command_and_expected_result(capsys):
    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    for path in FILES:
        config = shipped_config(path)
        with open(path) as f:
            expected = next(line for line in f if line.startswith("# Expected result: "))
        assert expected[len("# Expected result: "):].strip() in config.expected
        name = os.path.basename(path)[:-len(".yaml")]
        assert config.run == f"jdp train {name} --workdir runs/{name}"
        assert f"{name}: " in out and f"  run:      {config.run}\n  expected: {config.expected}\n" in out
    assert [c.name for c in shipped_configs()] == [os.path.basename(p)[:-5] for p in FILES]


def test_a_config_is_found_by_name_and_a_file_of_that_path_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    shipped = os.path.join(CONFIG_DIR, "char_gpt.yaml")
    for arg in ("char_gpt", "char_gpt.yaml", "configs/char_gpt.yaml"):
        assert resolve_config(arg) == shipped, arg
    (tmp_path / "char_gpt.yaml").write_text("train:\n  steps: 3\n")
    assert resolve_config("char_gpt.yaml") == "char_gpt.yaml"
    assert resolve_config(None) is None
    for bad in ("char_gptt", "../configs/char_gpt.yaml", "other/char_gpt"):
        with pytest.raises(ConfigError, match=f"^config '{bad}' is neither a file nor a shipped config; the shipped "
                                              "ones are char_gpt, char_gpt_bf16, "):
            resolve_config(bad)


def test_a_directory_is_never_a_config_and_a_shipped_name_wins_over_one(tmp_path, monkeypatch):
    # `jdp train digits_mlp --workdir digits_mlp`, run twice: the second finds the run's own workdir
    monkeypatch.chdir(tmp_path)
    (tmp_path / "digits_mlp").mkdir()
    assert resolve_config("digits_mlp") == os.path.join(CONFIG_DIR, "digits_mlp.yaml")
    (tmp_path / "mine").mkdir()
    done = subprocess.run([sys.executable, "-m", "jdp.run.cli", "train", "mine", "--workdir", "w"], capture_output=True,
                          text=True, env=child_env(), cwd=tmp_path, timeout=120)
    assert (done.returncode, done.stdout) == (2, "") and done.stderr == (
        "jdp: error: config 'mine' is a directory, and a directory is never a config; give a YAML file or the name of "
        "a shipped config: char_gpt, char_gpt_bf16, char_gpt_tokens, digits_cnn_syncbn, digits_mlp, "
        "digits_mlp_accum_psum, digits_mlp_bf16, gpt2_small, seed_linear, stdlib_bpe_gpt (jdp configs lists them).\n")
    assert sorted(os.listdir(tmp_path)) == ["digits_mlp", "mine"] and not os.listdir(tmp_path / "mine")


def test_a_workdir_named_like_its_config_resumes_as_any_workdir(tmp_path):
    cmd = [sys.executable, "-m", "jdp.run.cli", "train", "seed_linear", "--workdir", "seed_linear", "--no-progress"]
    first, second = (subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=tmp_path, timeout=300)
                     for _ in range(2))
    assert first.returncode == 0 and "done at step 1 of 1" in first.stdout, first.stderr[-2000:]
    assert second.returncode == 0, second.stderr[-2000:]
    assert "the run is complete (1 of 1 steps, trained earlier); workdir seed_linear" in second.stdout


def test_prepare_tokens_writes_the_reference_text_as_byte_tokens_and_never_overwrites(tmp_path, capsys):
    out = tmp_path / "tok"
    assert main(["data", "prepare-tokens", "python-reference", str(out), "--dtype", "uint32"]) == 0
    corpus = load_char_corpus()
    train, val = (np.fromfile(out / name, "<u4") for name in ("train.bin", "val.bin"))
    assert bytes(train.astype(np.uint8)).decode() == corpus.decode(corpus.train)
    assert bytes(val.astype(np.uint8)).decode() == corpus.decode(corpus.val)
    assert f"train.bin: {len(train):,} tokens" in capsys.readouterr().out
    before = (out / "train.bin").read_bytes()
    (tmp_path / "t.txt").write_text("abc" * 10)
    for argv, message in ((["t.txt", str(out)], f"'{out / 'train.bin'}', '{out / 'val.bin'}' and "
                                                f"'{out / 'meta.json'}' already exist; choose another OUTPUT"),
                          (["t.txt", str(tmp_path / "x"), "--dtype", "int8"], "--dtype 'int8' is not a token dtype"),
                          (["nothing.txt", str(tmp_path / "y")], "INPUT 'nothing.txt' is not a file")):
        assert main(["data", "prepare-tokens", *(str(tmp_path / a) if a == "t.txt" else a for a in argv)]) == 2
        assert capsys.readouterr().err.startswith(f"jdp: error: {message}")
    assert (out / "train.bin").read_bytes() == before
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
