"""Every source kind through make_batches: grain datasets, random-access objects, token files, ArrayRecord.

For each: the global batch does not depend on the process count, a mid-epoch state resumes
exactly, transforms are seeded from (seed, epoch, index), and bad items are named by index and key.
"""
import json
import os
import re
import subprocess
import sys

import grain
import numpy as np
import pytest

from jdp.data import (ArrayDataset, as_source, example_rng, load_array_record, load_tokens, make_batches,
                      shuffled_positions, write_array_record)
from jdp.data.order import EpochOrder


def take(it, k):
    return [next(it) for _ in range(k)]


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def items(n):
    """n examples that name themselves: {"id": (), "x": (3,) float32}."""
    return [{"id": np.int64(i), "x": np.full(3, i, np.float32)} for i in range(n)]


def write_tokens(path, tokens, dtype=np.uint16):
    np.asarray(tokens, dtype).tofile(path)
    return path


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "train.bin"
    return write_tokens(path, np.arange(1001))  # no two windows alike


@pytest.fixture(scope="module")
def record_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ar") / "data.array_record"
    write_array_record(path, items(90))
    return path


SOURCES = ["arrays", "grain", "list", "tokens", "array_record"]


@pytest.fixture
def source(request, token_file, record_file):
    """A source of each kind (with 90-ish examples); its "id" or "x" names each example."""
    kind = request.param
    if kind == "arrays":
        return ArrayDataset({"id": np.arange(90), "x": np.arange(90, dtype=np.float32)[:, None] * np.ones(3)})
    if kind == "grain":  # a grain pipeline with a map: jdp reads its items one by one
        return grain.MapDataset.source(items(90)).map(lambda d: {**d, "x": d["x"] * 2})
    if kind == "list":
        return items(90)
    if kind == "tokens":
        return load_tokens(token_file, context_length=10, vocab_size=1001)  # (1001 - 11) // 10 + 1 = 100 windows
    return load_array_record(record_file)


def global_batches(source, g, processes, steps, **kw):
    slices = [take(make_batches(source, g, process_index=p, num_processes=processes, **kw), steps)
              for p in range(processes)]
    return [{k: np.concatenate([s[i][k] for s in slices]) for k in slices[0][i]} for i in range(steps)]


@pytest.mark.parametrize("source", SOURCES, indirect=True)
@pytest.mark.parametrize("drop_last", [True, False])
def test_process_slices_concatenated_equal_one_process(source, drop_last):
    # G = 16 over ~90 examples: 12 steps cross into epoch 2 (with the padded tail when drop_last=False).
    one = global_batches(source, 16, 1, 12, seed=4, drop_last=drop_last, prefetch=0)
    for processes in (2, 4):
        same(global_batches(source, 16, processes, 12, seed=4, drop_last=drop_last, prefetch=0), one)


@pytest.mark.parametrize("source", SOURCES, indirect=True)
@pytest.mark.parametrize("stop", [2, 5, 6])  # mid-epoch, the last step of epoch 0, the first of epoch 1
def test_a_mid_epoch_state_resumes_exactly(source, stop):
    kw = dict(seed=9, process_index=1, num_processes=2)
    straight = take(make_batches(source, 16, **kw), 10)
    it = make_batches(source, 16, **kw)
    take(it, stop)
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    it.close()
    assert state["epoch"] * it.steps_per_epoch + state["step"] == stop
    same(take(make_batches(source, 16, start_state=state, **kw), 10 - stop), straight[stop:])
    moved = make_batches(source, 16, **kw)  # set_state on an iterator that has run ahead
    take(moved, 8)
    moved.set_state(state)
    same(take(moved, 10 - stop), straight[stop:])


@pytest.mark.parametrize("source", ["grain", "tokens", "array_record"], indirect=True)
def test_every_epoch_visits_every_example_once(source):
    n = len(source)
    it = make_batches(source, 8, seed=2, drop_last=False, prefetch=0)
    seen = [take(it, it.steps_per_epoch) for _ in range(2)]
    key = "x"
    for epoch in seen:
        rows = np.concatenate([b[key][b["mask"] == 1] for b in epoch])
        assert len(rows) == n and len(np.unique(rows, axis=0)) == n
    assert not np.array_equal(seen[0][0][key], seen[1][0][key])  # a new order every epoch


def test_non_array_sources_use_the_bijection_and_arrays_keep_the_permutation(token_file):
    tokens = load_tokens(token_file, context_length=10)
    first = next(make_batches(tokens, 8, seed=3, prefetch=0))
    expected = shuffled_positions(3, 0, len(tokens), np.arange(8))
    np.testing.assert_array_equal(first["x"][:, 0], [tokens.read(i * 10, 1)[0] for i in expected])
    assert make_batches(tokens, 8).get_state()["order"] == "bijection"
    assert make_batches({"x": np.arange(10)}, 2).get_state()["order"] == "permutation"
    as_perm = next(make_batches(tokens, 8, seed=3, order="permutation", prefetch=0))
    assert not np.array_equal(as_perm["x"], first["x"])


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_the_bijection_is_a_permutation_of_every_size(n):
    for seed, epoch in ((0, 0), (5, 3)):
        order = shuffled_positions(seed, epoch, n, np.arange(n))
        np.testing.assert_array_equal(np.sort(order), np.arange(n))
    if n > 8:
        assert not np.array_equal(shuffled_positions(0, 0, n, np.arange(n)), shuffled_positions(0, 1, n, np.arange(n)))
        assert not np.array_equal(shuffled_positions(0, 0, n, np.arange(n)), np.arange(n))


def test_the_bijection_needs_no_memory_per_example():
    n = 10**9  # a permutation of this n would hold 8 GB
    order = EpochOrder("bijection", 7, n)
    batch = order(2, np.arange(5 * 10**8, 5 * 10**8 + 4096))
    assert batch.dtype == np.int64 and batch.min() >= 0 and batch.max() < n and len(np.unique(batch)) == 4096
    assert order._cached[1].size == 0  # nothing kept between calls
    with pytest.raises(ValueError, match=r"order='random' is not an epoch order; use one of 'permutation', "
                                         r"'bijection'"):
        EpochOrder("random", 0, 10)


def random_shift(example, rng):
    """A random transform: the example's x plus noise from rng, and the noise's first draw."""
    noise = rng.normal(size=3).astype(np.float32)
    return {"id": example["id"], "x": example["x"] + noise, "draw": noise[:1]}


def test_a_random_transform_is_seeded_from_seed_epoch_and_index():
    source = grain.MapDataset.source(items(32))
    it = make_batches(source, 8, seed=6, transform=random_shift, prefetch=0)
    epoch0 = take(it, 4)
    epoch1 = take(it, 4)
    for epoch, batches in ((0, epoch0), (1, epoch1)):
        for b in batches:
            for i, draw in zip(b["id"], b["draw"]):
                np.testing.assert_array_equal(draw, example_rng(6, epoch, i).normal(size=3).astype(np.float32)[:1])
    by_id = lambda batches: {int(i): d for b in batches for i, d in zip(b["id"], b["draw"])}  # noqa: E731
    assert all(by_id(epoch0)[i] != by_id(epoch1)[i] for i in range(32))  # each epoch draws anew
    # The same examples on 4 processes get the same draws: the transform does not see the split.
    same(global_batches(source, 8, 4, 6, seed=6, transform=random_shift, prefetch=0),
         global_batches(source, 8, 1, 6, seed=6, transform=random_shift, prefetch=0))
    resumed = make_batches(source, 8, seed=6, transform=random_shift, start_state={**it.get_state(), "epoch": 1,
                                                                                  "step": 2})
    same(take(resumed, 2), epoch1[2:])


def test_threads_and_worker_processes_do_not_change_the_batches():
    source = grain.MapDataset.source(items(40)).map(lambda d: {**d, "x": d["x"] + 1})
    plain = take(make_batches(source, 8, seed=1, transform=random_shift, drop_last=False, prefetch=0), 7)
    threads = make_batches(source, 8, seed=1, transform=random_shift, drop_last=False, prefetch=4, threads=3)
    same(take(threads, 7), plain)
    threads.close()
    workers = make_batches(source, 8, seed=1, transform=random_shift, drop_last=False, prefetch=2, workers=2)
    try:
        same(take(workers, 4), plain[:4])
        workers.set_state({**workers.get_state(), "epoch": 0, "step": 1})  # restarts the workers from step 1
        same(take(workers, 3), plain[1:4])
    finally:
        workers.close()


def test_token_windows_follow_the_documented_definition(tmp_path):
    tokens = (np.arange(103) * 7) % 50
    path = write_tokens(tmp_path / "t.bin", tokens)
    for stride, windows in ((None, (103 - 8 - 1) // 8 + 1), (3, (103 - 8 - 1) // 3 + 1)):
        w = load_tokens(path, context_length=8, stride=stride)
        s = 8 if stride is None else stride
        assert len(w) == windows and w.spec() == {"x": ((8,), np.dtype(np.int32)), "y": ((8,), np.dtype(np.int32))}
        for i in (0, 5, windows - 1):
            np.testing.assert_array_equal(w[i]["x"], tokens[i * s:i * s + 8])
            np.testing.assert_array_equal(w[i]["y"], tokens[i * s + 1:i * s + 9])
            assert w[i]["x"].dtype == np.int32
    tiled = load_tokens(path, context_length=8)
    # stride T: 12 windows tile tokens 0..96; an epoch predicts tokens 1..96, each once.
    targets = np.concatenate([tiled[i]["y"] for i in range(len(tiled))])
    np.testing.assert_array_equal(targets, tokens[1:97])
    u8 = load_tokens(write_tokens(tmp_path / "u8.bin", tokens, np.uint8), context_length=8, dtype="uint8")
    np.testing.assert_array_equal(u8[3]["x"], tiled[3]["x"])


def test_token_files_are_pickled_by_path_not_by_content(token_file):
    import pickle

    tokens = load_tokens(token_file, context_length=10)
    _ = tokens[0]  # the map is open
    blob = pickle.dumps(tokens)
    assert len(blob) < 1000  # the 2 KB of tokens are not in it: a worker reopens the file
    np.testing.assert_array_equal(pickle.loads(blob)[4]["x"], tokens[4]["x"])


def test_the_token_digest_reads_a_sample_and_sees_size_and_content(tmp_path):
    base = np.arange(200_000) % 1000
    a = load_tokens(write_tokens(tmp_path / "a.bin", base), context_length=16).digest()
    assert a == load_tokens(write_tokens(tmp_path / "b.bin", base), context_length=16).digest()
    changed = base.copy()
    changed[0] += 1  # the first block is always sampled
    assert a != load_tokens(write_tokens(tmp_path / "c.bin", changed), context_length=16).digest()
    assert a != load_tokens(write_tokens(tmp_path / "d.bin", base[:-1]), context_length=16).digest()
    assert a != load_tokens(tmp_path / "a.bin", context_length=32).digest()


def test_array_record_reads_the_file_the_test_wrote(record_file):
    source = load_array_record(record_file)
    assert len(source) == 90 and source.spec() == {"id": ((), np.dtype(np.int64)), "x": ((3,), np.dtype(np.float32))}
    np.testing.assert_array_equal(source[17]["x"], [17, 17, 17])
    batch = next(make_batches(source, 10, seed=0, prefetch=0))
    np.testing.assert_array_equal(batch["x"][:, 0], batch["id"])
    assert source.digest() == load_array_record([record_file]).digest()


def test_array_record_takes_your_decode_for_records_of_another_format(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    path = str(tmp_path / "json.array_record")
    writer = ArrayRecordWriter(path, "group_size:1")
    for i in range(12):
        writer.write(json.dumps({"v": [i, i + 1]}).encode())
    writer.close()
    source = load_array_record(path, decode=lambda r: {"v": np.asarray(json.loads(r)["v"], np.int32)})
    np.testing.assert_array_equal(source[5]["v"], [5, 6])
    message = "a record starts with b'{\"v\"', not jdp's b'JDP1': it was not written by write_array_record"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_array_record(path)
    with pytest.raises(ValueError, match=r"no such ArrayRecord file: .*missing"):
        load_array_record(tmp_path / "missing")


@pytest.mark.parametrize("make, message", [
    (lambda p: write_tokens(p, np.arange(11)).write_bytes(p.read_bytes() + b"\x00"),
     r"holds 23 bytes, not a whole number of uint16 tokens \(2 bytes each\); it is damaged or holds another dtype"),
    (lambda p: write_tokens(p, np.arange(8)), r"holds 8 tokens, fewer than one window of context_length \+ 1 = 9 "
                                              r"tokens"),
    (lambda p: write_tokens(p, [1, 2, 3, 4, 5, 6, 7, 8, 300, 1]), r"holds the token id 300 at position 8, not "
                                                                   r"below vocab_size=256"),
    pytest.param(lambda p: write_tokens(p, [1, 2, 3, 4, 5, 6, 7, 8, 1, 300]), r"holds the token id 300 at position 9,",
                 id="the last token, the last of a sampled block"),
])
def test_bad_token_files_raise_one_sentence(tmp_path, make, message):
    path = tmp_path / "bad.bin"
    make(path)
    with pytest.raises(ValueError, match=message):
        load_tokens(path, context_length=8, vocab_size=256)


def test_a_token_id_outside_the_sample_is_refused_when_its_batch_is_read(tmp_path):
    tokens = np.zeros(1_000_000, np.uint16)
    tokens[123_457] = 999  # between the 32 sampled blocks of 4096 tokens
    tokens_source = load_tokens(write_tokens(tmp_path / "t.bin", tokens), context_length=64, vocab_size=256)
    with pytest.raises(ValueError, match=r"holds the token id 999 at position 123457, not below vocab_size=256"):
        tokens_source.take(np.arange(len(tokens_source)))
    it = make_batches(tokens_source, len(tokens_source), prefetch=2)  # one epoch in one batch: the bad window is read
    with pytest.raises(ValueError, match=r"token id 999 at position 123457"):
        next(it)
    it.close()
    with pytest.raises(ValueError, match=r"no such token file: .*missing.bin"):
        load_tokens(tmp_path / "missing.bin", context_length=4)
    with pytest.raises(ValueError, match=r"dtype='int16' is not a token dtype; use one of 'uint8', 'uint16', "
                                         r"'uint32'"):
        load_tokens(tmp_path / "t.bin", context_length=4, dtype="int16")


@pytest.mark.parametrize("bad, message", [
    ({"x": np.zeros(3, np.float32)}, r"item 5 of the source lacks the key 'id'; every item needs the keys of item 0"),
    ({"id": np.int64(5), "x": np.zeros(3, np.float32), "z": np.zeros(1)}, r"item 5 of the source has the extra key "
                                                                          r"'z'"),
    ({"id": np.int64(5), "x": np.zeros(4, np.float32)}, r"item 5 of the source has 'x' of shape \(4,\) and dtype "
                                                        r"float32, but item 0's is \(3,\) float32"),
    ({"id": np.int64(5), "x": np.zeros(3, np.float64)}, r"item 5 of the source has 'x' of shape \(3,\) and dtype "
                                                        r"float64, but item 0's is \(3,\) float32"),
    ([1, 2], r"item 5 of the source is a list; a source's items must be non-empty dicts of numpy arrays"),
])
def test_an_item_unlike_item_0_is_named_by_index_and_key(bad, message):
    data = items(100)
    data[5] = bad  # not among the 8 items sampled when the source is made (0, 14, 28, ..., 99)
    it = make_batches(data, 100, prefetch=0)
    with pytest.raises(ValueError, match=message):
        next(it)
    data[99] = bad  # the last item is sampled: refused before any batch is read
    with pytest.raises(ValueError, match=message.replace("item 5", "item 99")):
        as_source(data)


def test_sources_that_are_not_sources_are_refused():
    with pytest.raises(ValueError, match=r"a source needs __len__ and __getitem__ \(e.g. a grain.MapDataset\), got "
                                         r"a int"):
        as_source(5)
    with pytest.raises(ValueError, match=r"the source is empty \(len 0\)"):
        as_source([])
    with pytest.raises(ValueError, match=r"item 0 of the source has 'x' of dtype <U1; items hold numeric"):
        as_source([{"x": np.array("a")}])
    with pytest.raises(ValueError, match=r"transform must be callable as transform\(example, rng\), got int"):
        make_batches(items(4), 2, transform=3)
    with pytest.raises(ValueError, match=r"transform\(item 0, rng\) is a NoneType"):
        make_batches(items(4), 2, transform=lambda e, rng: None)


def test_a_state_saved_before_the_order_key_existed_resumes_arrays_only(token_file):
    arrays = {"id": np.arange(40)}
    it = make_batches(arrays, 8, seed=1)
    take(it, 3)
    old = {k: v for k, v in it.get_state().items() if k != "order"}  # what earlier checkpoints hold
    same(take(make_batches(arrays, 8, seed=1, start_state=old), 2), take(it, 2))
    tokens = load_tokens(token_file, context_length=10)
    old_tokens = {k: v for k, v in make_batches(tokens, 8).get_state().items() if k != "order"}
    with pytest.raises(ValueError, match=r"the saved data state has order='permutation' but this iterator has "
                                         r"order='bijection'; resume with the same dataset and settings"):
        make_batches(tokens, 8, start_state=old_tokens)


@pytest.mark.parametrize("source", ["tokens", "array_record"], indirect=True)
def test_worker_processes_reopen_file_sources_and_give_the_same_batches(source):
    plain = take(make_batches(source, 16, seed=8, prefetch=0), 8)  # crosses into epoch 1
    workers = make_batches(source, 16, seed=8, prefetch=2, workers=2)
    try:
        same(take(workers, 8), plain)
    finally:
        workers.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RssAnon is read from Linux's /proc")
def test_a_token_file_is_never_read_whole(tmp_path):
    # A fresh process opens a 512 MiB sparse token file and reads 200 batches of 64 windows: its
    # anonymous memory grows by far less than the file (the page cache of its reads is not anonymous).
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(512 * 2**20)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "benchmarks.data", "memory", str(path), "200"], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["after_batches"] - m["after_import"] < 64 * 2**20, m  # grain's import and the batches, not the file
    assert m["after_batches"] - m["after_open"] < 8 * 2**20, m


def test_the_id_equal_to_vocab_size_is_refused_when_the_file_opens_and_when_its_batch_is_read(tmp_path):
    # ids run 0..vocab_size - 1: vocab_size itself is the first id out of range, in both checks
    path = write_tokens(tmp_path / "t.bin", [1, 2, 3, 4, 5, 6, 7, 8, 256, 1])
    with pytest.raises(ValueError, match=r"holds the token id 256 at position 8, not below vocab_size=256"):
        load_tokens(path, context_length=8, vocab_size=256)
    write_tokens(path, [1, 2, 3, 4, 5, 6, 7, 8, 255, 1])
    tokens = load_tokens(path, context_length=8, vocab_size=256)  # 255 is the last id that fits
    np.testing.assert_array_equal(tokens.take(np.array([0]))["y"], [[2, 3, 4, 5, 6, 7, 8, 255]])
    with open(path, "r+b") as f:  # the same size, another id: only the batch's own check sees it
        f.seek(8 * 2)
        f.write(np.uint16(256).tobytes())
    with pytest.raises(ValueError, match=r"holds the token id 256 at position 8, not below vocab_size=256"):
        tokens.take(np.array([0]))


def test_a_short_read_is_a_changed_token_file_not_a_batch_of_fewer_tokens(tmp_path, monkeypatch):
    # A file truncated between the size check and the read: os.pread returns fewer bytes than asked
    from jdp.data.tokens import TokenFileChangedError

    tokens = load_tokens(write_tokens(tmp_path / "t.bin", np.arange(40)), context_length=8, vocab_size=256)
    pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, size, offset: pread(fd, size, offset)[:-2])
    with pytest.raises(TokenFileChangedError, match=r"changed while the run read it"):
        tokens.take(np.array([0, 3]))
    with pytest.raises(TokenFileChangedError, match=r"changed while the run read it"):
        tokens.read(0, 4)
