"""`jdp data prepare-tokens`' encoders and reading: tiktoken where it reproduces a byte-level BPE
(checked against the tokenizers library), the library otherwise, the same ids on 1 and 2 worker
processes, each input read once (its digest of the very bytes encoded), and the uint16/uint32
boundary. Tiny tokenizers and texts; nothing is compiled."""
import hashlib
import json
import sys

import numpy as np
import pytest

from jdp.data import prepare as P
from jdp.data import text_inputs
from jdp.data.encoders import byte_alphabet
from jdp.data.tokenizer import dtype_for, read_metadata
from jdp.run.cli import main

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("tiktoken")

# Awkward for a chunked encoder: non-ASCII letters, digits, emoji (4 UTF-8 bytes), a combining mark,
# runs of spaces, tabs and newlines, contractions, a word longer than a small chunk, and GPT-2's
# <|endoftext|> as plain text.
AWKWARD = ("Ünïcödé wörds and 数字 12345 🙂🙂 e\u0301 it's we'll   \t  spaces\n\n\n   \t\tindent "
           "supercalifragilisticexpialidocious <|endoftext|> x=1;y=2  \r\n") * 30 + "end é"


def bpe_json(path, text=AWKWARD, vocab=400, added=()):
    """A byte-level BPE trained by the tokenizers library (the kind tiktoken reproduces), saved as a tokenizer.json."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator([text], tokenizers.trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=list(added)))
    tok.save(str(path))
    return tok


def ids(folder):
    meta = read_metadata(folder)
    return [np.fromfile(folder / f"{s}.bin", f"<u{2 if meta['dtype'] == 'uint16' else 4}").tolist()
            for s in ("train", "val")]


def test_tiktoken_the_library_and_1_or_2_workers_give_the_librarys_ids_of_each_split(tmp_path, monkeypatch, capsys):
    src = tmp_path / "t.txt"
    src.write_bytes(AWKWARD.encode())
    tok = bpe_json(tmp_path / "tok.json", added=["<|endoftext|>"])
    text = AWKWARD.replace("\r\n", "\n")
    n = int(round(len(text) * 0.9))  # inside a word: the split is a character, as for bytes
    want = [tok.encode(text[:n], add_special_tokens=False).ids, tok.encode(text[n:], add_special_tokens=False).ids]
    assert 0 < len(want[1]) and tok.token_to_id("<|endoftext|>") in want[0]  # the library matches it as a token
    said = {}
    # chunk_chars 12: chunks of up to 24 characters, cut before whitespace, or inside the 34-letter word
    # (a cut inside a pre-token: the same for every encoder); read_bytes 5 splits characters between reads
    for name, workers in (("one", 1), ("two", 2)):
        assert main(["data", "prepare-tokens", str(src), str(tmp_path / name), "--tokenizer",
                     str(tmp_path / "tok.json"), "--workers", str(workers), "--no-progress"]) == 0
        said[name] = capsys.readouterr().err
    kw = dict(tokenizer=str(tmp_path / "tok.json"), chunk_chars=12, read_bytes=5)
    P.prepare(str(src), str(tmp_path / "small1"), workers=1, **kw)
    P.prepare(str(src), str(tmp_path / "small2"), workers=2, **kw)
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # not installed: the library encodes, and says why once
    notes = []
    P.prepare(str(src), str(tmp_path / "lib"), workers=2, note=notes.append, **kw)
    for name in ("one", "two"):
        assert ids(tmp_path / name) == want, name
        assert read_metadata(tmp_path / name)["encoder"]["engine"] == "tiktoken"
    version = read_metadata(tmp_path / "one")["encoder"]["version"]
    assert said["two"] == (f"encoding with tiktoken {version} on 2 worker processes: its ids equal the tokenizers "
                           f"library's on the first {len(text):,} characters\n")
    assert ids(tmp_path / "small1") == ids(tmp_path / "small2") == ids(tmp_path / "lib")  # one chunking, 3 encoders
    assert read_metadata(tmp_path / "small2")["encoder"]["engine"] == "tiktoken"
    assert read_metadata(tmp_path / "lib")["encoder"]["engine"] == "tokenizers"
    assert len(notes) == 1 and notes[0].startswith("encoding with the tokenizers library ") and notes[0].endswith(
        " on 2 worker processes: tiktoken is not installed (install it with "
        f"{__import__('jdp.extras').extras.install_command('tokenizers')})")


def test_a_tokenizer_tiktoken_does_not_reproduce_falls_back_to_the_library_and_says_why(tmp_path):
    # merges in another order than the ids: the library merges "b c" first, tiktoken the lower rank "ab"
    alphabet = list(byte_alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {"ab": 256, "bc": 257}
    model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
             "vocab": vocab, "merges": [["b", "c"], ["a", "b"]]}
    config = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
              "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                "use_regex": True},
              "post_processor": None, "decoder": None, "model": model}
    (tmp_path / "order.json").write_text(json.dumps(config))
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "abc": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "words.json"))
    (tmp_path / "t.txt").write_text("abc abcabc cab " * 20)
    lib = tokenizers.Tokenizer.from_file(str(tmp_path / "order.json"))
    for name, why in (("order", "tiktoken's ids differ from the tokenizers library's on the first 300 characters "
                                "(from token 0 on)"),
                      ("words", "tiktoken cannot reproduce this tokenizer: its model is 'WordLevel', not a BPE")):
        notes = []
        meta = P.prepare(str(tmp_path / "t.txt"), str(tmp_path / name), tokenizer=str(tmp_path / f"{name}.json"),
                         workers=1, note=notes.append)
        assert meta["encoder"]["engine"] == "tokenizers" and meta["encoder"]["why"] == why
        assert notes == [P.encoder_line(meta["encoder"], 1)] and notes[0].endswith(f" on 1 worker process: {why}")
    text = "abc abcabc cab " * 20
    assert ids(tmp_path / "order") == [lib.encode(text[:270]).ids, lib.encode(text[270:]).ids]
    assert lib.encode("abc").ids == [ord("a") - 33, 257]  # the library's own order, which tiktoken would not give


def test_each_input_is_read_once_and_its_sha256_is_of_the_bytes_encoded(tmp_path, monkeypatch):
    src = tmp_path / "grows.txt"
    src.write_bytes(b"first version of the text, " * 40)
    read = []
    real = text_inputs._read_blocks

    def read_then_change(path, read_bytes):  # the file is rewritten (and grows) after its first block is read
        for i, block in enumerate(real(path, read_bytes)):
            read.append(block)
            yield block
            if i == 0:
                src.write_bytes(b"SECOND VERSION, LONGER, " * 90)

    monkeypatch.setattr(text_inputs, "_read_blocks", read_then_change)
    meta = P.prepare(str(src), str(tmp_path / "out"), read_bytes=64)
    seen = b"".join(read)
    assert (tmp_path / "out" / "train.bin").exists() and len(read) > 2 and seen != src.read_bytes()
    assert meta["inputs"] == [{"path": str(src), "sha256": hashlib.sha256(seen).hexdigest()}]
    n = int(round(len(seen) * 0.9))
    assert [bytes(s) for s in ids(tmp_path / "out")] == [seen[:n], seen[n:]]  # the text read once, split exactly
    assert meta["splits"]["val"]["characters"] == len(seen) - n
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["meta.json", "train.bin", "val.bin"]  # no spool


@pytest.mark.parametrize("top", [65_535, 65_536])
def test_65536_ids_fit_uint16_and_65537_need_uint32(tmp_path, top):
    vocab = top + 1
    assert dtype_for(vocab) == ("uint16" if vocab <= 65_536 else "uint32")
    wide = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1, "b": top}, unk_token="[UNK]"))
    wide.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    wide.save(str(tmp_path / "wide.json"))
    (tmp_path / "t.txt").write_text("a b c " * 20)
    for name, dtype in (("auto", None), ("given", "uint16" if vocab == 65_536 else "uint32")):
        meta = P.prepare(str(tmp_path / "t.txt"), str(tmp_path / name), tokenizer=str(tmp_path / "wide.json"),
                         dtype=dtype, workers=1)
        assert (meta["vocab_size"], meta["dtype"]) == (vocab, "uint16" if vocab == 65_536 else "uint32")
        assert (tmp_path / name / "train.bin").stat().st_size == meta["splits"]["train"]["tokens"] * (
            2 if vocab == 65_536 else 4)
        assert ids(tmp_path / name)[0][:3] == [1, top, 0]


def test_workers_default_to_the_cores_but_one_per_16_mi_characters_and_are_at_least_1(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("some text " * 10)
    with pytest.raises(SystemExit) as exit:  # argparse's refusal: its usage line and one sentence
        main(["data", "prepare-tokens", str(tmp_path / "t.txt"), str(tmp_path / "out"), "--workers", "0"])
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert err.endswith("argument --workers: 0 must be at least 1\n") and "Traceback" not in err
    with pytest.raises(ValueError, match=r"^--workers 0 must be a whole number of processes, at least 1\.$"):
        P.prepare(str(tmp_path / "t.txt"), str(tmp_path / "out"), workers=0)
    assert not (tmp_path / "out").exists()
    import os

    cores = len(os.sched_getaffinity(0))
    assert P.default_workers() == P.default_workers(10**12) == cores  # one per core for a large text
    assert P.default_workers(P.WORKER_CHARS) == 1 and P.default_workers(0) == 1  # a small one: no process to start
    assert P.default_workers(P.WORKER_CHARS + 1) == min(2, cores)


def test_ctrl_c_removes_what_the_run_wrote_and_gives_the_handler_back(tmp_path):
    import os
    import signal

    (tmp_path / "t.txt").write_text(AWKWARD)
    bpe_json(tmp_path / "tok.json")
    seen = []
    theirs = signal.signal(signal.SIGINT, lambda *a: seen.append("theirs"))  # jdp's command exits at once here
    try:
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C while the files are being written
            P.prepare(str(tmp_path / "t.txt"), str(tmp_path / "out"), tokenizer=str(tmp_path / "tok.json"), workers=1,
                      note=lambda line: os.kill(os.getpid(), signal.SIGINT))
        assert seen == [] and not (tmp_path / "out").exists()  # no .partial file, text.partial included, is left
        signal.raise_signal(signal.SIGINT)
        assert seen == ["theirs"]  # the caller's handler is back
    finally:
        signal.signal(signal.SIGINT, theirs)
