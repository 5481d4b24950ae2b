"""`jdp data prepare-tokens` with a tokenizer (bytes, a BPE trained here, a tokenizer.json), its
inputs (files, globs, .jsonl), meta.json and what `jdp train` takes from it, and its refusals
(empty input, existing files, a planted .partial link, a config that disagrees with meta.json).
Real files and the real command line; tokenizers are tiny, nothing is compiled."""
import hashlib
import json
import os

import numpy as np
import pytest

from jdp.data import prepare as P
from jdp.data.text_inputs import chunks
from jdp.data.tokenizer import load_tokenizer, read_metadata
from jdp.run.cli import main
from jdp.run.config import load_config, validate
from jdp.run.sections import ConfigError
from jdp.run.shipped import CONFIG_DIR

tokenizers = pytest.importorskip("tokenizers")

TEXT = ("def f(x):\r\n    return x  # héllo wörld\n\n\n    if x:\n        pass\n\tclass Ω: pass\n" * 40
        + "tail without newline é")


def old_byte_files(text: str, val_fraction: float = 0.1) -> tuple[bytes, bytes]:
    """What prepare-tokens wrote before tokenizers and meta.json: the split at round(chars × 0.9), each part's UTF-8 bytes as uint16."""
    n = int(round(len(text) * (1 - val_fraction)))
    return tuple(np.frombuffer(part.encode(), np.uint8).astype("<u2").tobytes() for part in (text[:n], text[n:]))


def tiny_bpe(path, text=TEXT, vocab=300):
    """A byte-level BPE trained with the tokenizers library itself, saved as a tokenizer.json."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator([text], tokenizers.trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(path))
    return tok


def test_bytes_by_default_are_the_files_of_before_read_in_chunks_and_meta_json_says_what_they_hold(tmp_path):
    src = tmp_path / "t.txt"
    src.write_bytes(TEXT.encode())
    text = TEXT.replace("\r\n", "\n")  # read as text mode reads it, as before
    train, val = old_byte_files(text)
    for out, kw in (("a", {}), ("b", dict(chunk_chars=5, read_bytes=7))):  # 7-byte reads split the UTF-8 of é
        meta = P.prepare(str(src), str(tmp_path / out), **kw)
        assert (tmp_path / out / "train.bin").read_bytes() == train
        assert (tmp_path / out / "val.bin").read_bytes() == val
    assert sorted(os.listdir(tmp_path / "b")) == ["meta.json", "train.bin", "val.bin"]
    written = read_metadata(tmp_path / "b")
    assert written == {k: v for k, v in meta.items() if k not in ("seconds", "workers")}
    n = int(round(len(text) * 0.9))
    assert (written["vocab_size"], written["dtype"], written["tokenizer"]) == (256, "uint16", {
        "kind": "bytes", "file": None, "spec": "bytes"})
    assert written["splits"] == {"train": {"tokens": len(train) // 2, "bytes": len(text[:n].encode()), "characters": n},
                                 "val": {"tokens": len(val) // 2, "bytes": len(text[n:].encode()),
                                         "characters": len(text) - n}}
    assert written["inputs"] == [{"path": str(src), "sha256": hashlib.sha256(TEXT.encode()).hexdigest()}]
    assert load_tokenizer(tmp_path / "b").decode(np.fromfile(tmp_path / "b" / "val.bin", "<u2")) == text[n:]


def test_chunks_are_cut_where_the_pre_tokenizer_splits_anyway():
    pieces = ["ab\n", "  c\nd", "\n\n e\nf" * 3, "xyzxyzxyz"]
    for size in (1, 2, 3, 5, 100):
        out = list(chunks(pieces, size))
        assert "".join(out) == "".join(pieces) and max(map(len, out)) <= 2 * size
        cuts = [(c, nxt) for c, nxt in zip(out, out[1:]) if len(c) < 2 * size]  # not cut hard at 2·size
        assert all(not c[-1].isspace() and nxt[0].isspace() for c, nxt in cuts), (size, out)
        assert size < 3 or size == 100 or cuts


def test_a_tokenizer_json_encodes_the_splits_as_the_library_does_whatever_the_chunk_size(tmp_path):
    (tmp_path / "t.txt").write_text(TEXT)
    tok = tiny_bpe(tmp_path / "tok.json")
    text = TEXT.replace("\r\n", "\n")
    n = int(round(len(text) * 0.9))
    for out, kw in (("a", {}), ("b", dict(chunk_chars=16, read_bytes=5))):
        P.prepare(str(tmp_path / "t.txt"), str(tmp_path / out), tokenizer=str(tmp_path / "tok.json"), **kw)
        for name, part in (("train.bin", text[:n]), ("val.bin", text[n:])):
            assert np.fromfile(tmp_path / out / name, "<u2").tolist() == tok.encode(part).ids, (out, name)
    meta = read_metadata(tmp_path / "b")
    assert meta["vocab_size"] == tok.get_vocab_size() == 300 and meta["tokenizer"]["kind"] == "file"
    assert meta["splits"]["val"]["bytes"] == len(text[n:].encode())
    loaded = load_tokenizer(tmp_path / "b")
    assert (loaded.kind, loaded.vocab_size) == ("file", 300)
    assert loaded.decode(np.fromfile(tmp_path / "b" / "val.bin", "<u2")) == text[n:]


def test_bpe_is_trained_here_on_the_training_split_deterministically(tmp_path, capsys):
    (tmp_path / "t.txt").write_text(TEXT)
    for out in ("a", "b"):
        assert main(["data", "prepare-tokens", str(tmp_path / "t.txt"), str(tmp_path / out), "--tokenizer", "bpe:290",
                     "--no-progress"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("trained a byte-level BPE of 290 ids on ")
    assert printed[2].startswith("wrote ") and " tokens (vocab 290, uint16) in " in printed[2]
    assert printed[3] == f"train on it: jdp train stdlib_bpe_gpt --set data.path={tmp_path / 'a'}"
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    tok = load_tokenizer(tmp_path / "a")
    assert (tok.kind, tok.vocab_size) == ("bpe", 290)
    ids = np.fromfile(tmp_path / "a" / "train.bin", "<u2")
    assert ids.max() < 290 and len(ids) < len(TEXT) / 2  # merges, not bytes
    assert tok.decode(ids) + tok.decode(np.fromfile(tmp_path / "a" / "val.bin", "<u2")) == TEXT.replace("\r\n", "\n")


def test_more_than_65536_ids_are_written_as_uint32(tmp_path):
    wide = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1, "b": 70_000}, unk_token="[UNK]"))
    wide.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    wide.save(str(tmp_path / "wide.json"))
    (tmp_path / "t.txt").write_text("a b c " * 20)
    meta = P.prepare(str(tmp_path / "t.txt"), str(tmp_path / "out"), tokenizer=str(tmp_path / "wide.json"))
    assert (meta["vocab_size"], meta["dtype"]) == (70_001, "uint32")
    assert np.fromfile(tmp_path / "out" / "train.bin", "<u4")[:3].tolist() == [1, 70_000, 0]
    with pytest.raises(ValueError, match="^--dtype uint16 holds at most 65,536 ids, and the tokenizer has 70,001; "):
        P.prepare(str(tmp_path / "t.txt"), str(tmp_path / "out16"), tokenizer=str(tmp_path / "wide.json"),
                  dtype="uint16")
    assert not (tmp_path / "out16").exists()


def test_jsonl_records_and_globs_of_several_files_are_read_in_order(tmp_path):
    (tmp_path / "docs").mkdir()
    for name, body in (("b.txt", "second file\n"), ("a.txt", "first file, no newline"), ("c.md", "not matched")):
        (tmp_path / "docs" / name).write_text(body * 5)
    records = [{"text": "record one", "id": 1}, {"text": "record two\nwith a line", "id": 2}]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    P.prepare([str(tmp_path / "docs" / "*.txt"), str(tmp_path / "r.jsonl")], str(tmp_path / "out"), val_fraction=0.2)
    text = "first file, no newline" * 5 + "second file\n" * 5 + "record one\nrecord two\nwith a line\n"
    got = (np.fromfile(tmp_path / "out" / "train.bin", "<u2").astype(np.uint8).tobytes()
           + np.fromfile(tmp_path / "out" / "val.bin", "<u2").astype(np.uint8).tobytes())
    assert got.decode() == text
    assert [i["path"] for i in read_metadata(tmp_path / "out")["inputs"]] == [
        str(tmp_path / "docs" / "a.txt"), str(tmp_path / "docs" / "b.txt"), str(tmp_path / "r.jsonl")]
    (tmp_path / "body.jsonl").write_text(json.dumps({"body": "x" * 50}) + "\n")
    P.prepare(str(tmp_path / "body.jsonl"), str(tmp_path / "body"), field="body")
    with pytest.raises(ValueError, match=r"^line 1 of INPUT '.*body.jsonl' has no field 'text'; name the record's "):
        P.prepare(str(tmp_path / "body.jsonl"), str(tmp_path / "nobody"))
    with pytest.raises(ValueError, match=r"^INPUT '.*\*.rst' matches no file\.$"):
        P.prepare(str(tmp_path / "docs" / "*.rst"), str(tmp_path / "none"))


def refused(argv, capsys) -> str:
    assert main(["data", "prepare-tokens", *map(str, argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jdp: error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err[len("jdp: error: "):].strip()


def test_an_empty_input_is_refused_and_nothing_is_written(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "one.txt").write_text("x")
    assert refused([tmp_path / "empty.txt", tmp_path / "out"], capsys) == (
        f"INPUT '{tmp_path / 'empty.txt'}' holds no text; there is nothing to tokenize.")
    assert refused([tmp_path / "one.txt", tmp_path / "out"], capsys) == (
        f"INPUT '{tmp_path / 'one.txt'}' holds 1 character, too few to hold out --val-fraction 0.1 and train on the "
        "rest; give more text.")
    assert not (tmp_path / "out").exists()


def test_a_planted_partial_link_is_refused_and_nothing_outside_output_is_written(tmp_path, capsys):
    (tmp_path / "t.txt").write_text(TEXT)
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(outside, out / "val.bin.partial")
    assert refused([tmp_path / "t.txt", out], capsys) == (
        f"'{out / 'val.bin.partial'}' already exists (left by a prepare-tokens that was stopped, or one writing there "
        "now); delete it or choose another OUTPUT folder.")
    assert outside.read_text() == "keep me"
    assert sorted(os.listdir(out)) == ["val.bin.partial"]  # this run's own train.bin.partial removed again
    assert os.readlink(out / "val.bin.partial") == str(outside)


def test_existing_files_are_never_overwritten(tmp_path, capsys):
    (tmp_path / "t.txt").write_text(TEXT)
    out = tmp_path / "out"
    P.prepare(str(tmp_path / "t.txt"), str(out))
    assert refused([tmp_path / "t.txt", out, "--tokenizer", "bpe:300"], capsys) == (
        f"'{out / 'train.bin'}', '{out / 'val.bin'}' and '{out / 'meta.json'}' already exist; choose another OUTPUT "
        "folder or delete the token files there first.")
    (out / "train.bin").unlink()
    (out / "val.bin").unlink()
    (out / "meta.json").unlink()
    (out / "tokenizer.json").write_text("mine")
    assert refused([tmp_path / "t.txt", out, "--tokenizer", "bpe:300"], capsys).startswith(
        f"'{out / 'tokenizer.json'}' already exists; ")
    assert (out / "tokenizer.json").read_text() == "mine" and os.listdir(out) == ["tokenizer.json"]
    files = P._Files(str(tmp_path / "race"), ["train.bin"])  # a name that appears after the check
    files.check()
    with files.open("train.bin") as f:
        f.write(b"new")
    (tmp_path / "race" / "train.bin").write_bytes(b"theirs")
    with pytest.raises(ValueError, match="train.bin' appeared while prepare-tokens wrote it; it is left as it is"):
        files.publish()
    assert (tmp_path / "race" / "train.bin").read_bytes() == b"theirs"


def test_bad_tokenizer_specs_are_one_sentence(tmp_path, capsys):
    (tmp_path / "t.txt").write_text(TEXT)
    (tmp_path / "bad.json").write_text("{}")
    for spec, message in (("bpe:abc", "--tokenizer 'bpe:abc': VOCAB must be a whole number of ids, e.g. bpe:4096."),
                          ("bpe:100", "--tokenizer bpe:100: VOCAB must be between 257 (the 256 bytes and a merge) and "
                                      "1,048,576."),
                          ("gpt2", "--tokenizer 'gpt2' is not bytes, bpe:VOCAB (e.g. bpe:4096) or the path of a "
                                   "tokenizer.json file.")):
        assert refused([tmp_path / "t.txt", tmp_path / "out", "--tokenizer", spec], capsys) == message
    assert refused([tmp_path / "t.txt", tmp_path / "out", "--tokenizer", tmp_path / "bad.json"], capsys).startswith(
        f"'{tmp_path / 'bad.json'}' is not a tokenizer.json the tokenizers library reads (")
    assert not (tmp_path / "out").exists()


def test_jdp_train_takes_vocab_size_and_dtype_from_meta_json_and_refuses_a_config_that_disagrees(tmp_path, capsys,
                                                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text(TEXT * 3)
    P.prepare("t.txt", "prep", tokenizer="bpe:300")
    config = load_config(os.path.join(CONFIG_DIR, "stdlib_bpe_gpt.yaml"), ["data.path=prep"])
    d = config.data
    assert (d.path, d.val_path, d.vocab_size, d.dtype) == ("prep/train.bin", "prep/val.bin", 300, "uint16")
    assert load_config(None, ["model.name=gpt", "data.name=tokens", "data.path=prep/train.bin"]).data.vocab_size == 300
    for key, value, said in (("vocab_size", "256", "256"), ("dtype", "uint32", "'uint32'")):
        message = (f"data.{key}={said} disagrees with the tokens prepared in 'prep', whose meta.json says {key} "
                   f"{300 if key == 'vocab_size' else repr('uint16')}; leave data.{key} out of the config to take it "
                   "from there.")
        with pytest.raises(ConfigError, match=f"^{message}$".replace("(", r"\(").replace(")", r"\)")):
            load_config(None, ["model.name=gpt", "data.name=tokens", "data.path=prep", f"data.{key}={value}"])
    assert main(["train", "char_gpt_tokens", "--set", "data.path=prep", "--workdir", "w", "--no-progress"]) == 2
    assert capsys.readouterr().err == ("jdp: error: data.vocab_size=256 disagrees with the tokens prepared in 'prep', "
                                       "whose meta.json says vocab_size 300; leave data.vocab_size out of the config to "
                                       "take it from there.\n")
    assert not (tmp_path / "w").exists()
    with pytest.raises(ValueError, match="^no such folder of prepared tokens: 'nothing'.$"):
        load_tokenizer("nothing")
    os.mkdir("bare")
    assert load_tokenizer("bare").kind == "bytes"  # token files written before meta.json existed
    with pytest.raises(ConfigError, match="^data.path='bare' is a folder without meta.json; name its token file"):
        load_config(None, ["model.name=gpt", "data.name=tokens", "data.path=bare"])
    validate(config, 4)


def test_without_the_tokenizers_extra_bpe_names_the_install_command(tmp_path, monkeypatch):
    import sys

    (tmp_path / "t.txt").write_text(TEXT)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
    with pytest.raises(ValueError, match=r"^--tokenizer bpe:VOCAB needs tokenizers, which is not installed here; "
                                         r"install it with pip install .*\[tokenizers\]'$"):
        P.prepare(str(tmp_path / "t.txt"), str(tmp_path / "out"), tokenizer="bpe:300")
    assert not (tmp_path / "out").exists()
    P.prepare(str(tmp_path / "t.txt"), str(tmp_path / "bytes"))  # bytes need nothing
    import tomllib

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["tokenizers"] == ["tokenizers>=0.20", "tiktoken>=0.7"]
    assert {"tokenizers>=0.20", "tiktoken>=0.7"} <= set(extras["test"])
