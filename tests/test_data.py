"""The input pipeline: global batches independent of the process count, exact resume, padding, datasets."""
import json
import pickle

import numpy as np
import pytest

from jdp.data import (ArrayDataset, char_windows, epoch_order, load_arrays, load_char_corpus, load_digits,
                      load_seed_regression, make_batches)


def ids(n: int) -> dict:
    """A dataset whose only array names each example: batches show which examples they hold."""
    return {"id": np.arange(n), "x": np.arange(n, dtype=np.float32)[:, None] * np.ones(3, np.float32)}


def take(it, k: int) -> list[dict]:
    return [next(it) for _ in range(k)]


def global_batches(n, g, p_count, steps, **kw) -> list[dict]:
    """The first `steps` global batches, rebuilt by concatenating the slices of `p_count` processes."""
    slices = [take(make_batches(ids(n), g, process_index=p, num_processes=p_count, **kw), steps)
              for p in range(p_count)]
    return [{k: np.concatenate([s[i][k] for s in slices]) for k in slices[0][i]} for i in range(steps)]


def assert_same_batches(a: list[dict], b: list[dict]):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


@pytest.mark.parametrize("drop_last", [True, False])
def test_global_batch_is_independent_of_process_count(drop_last):
    # 100 examples, G = 16: 6 full batches and a tail of 4; 14 steps cross into epoch 2.
    reference = global_batches(100, 16, 1, 14, seed=3, drop_last=drop_last)
    for p_count in (2, 4, 8):
        assert_same_batches(global_batches(100, 16, p_count, 14, seed=3, drop_last=drop_last), reference)
    assert all(b["id"].shape == (16,) and b["x"].shape == (16, 3) for b in reference)


def test_process_slices_are_disjoint_and_contiguous():
    whole = take(make_batches(ids(64), 16, seed=1), 4)
    for p_count in (2, 4, 8):
        slices = [take(make_batches(ids(64), 16, seed=1, process_index=p, num_processes=p_count), 4)
                  for p in range(p_count)]
        for s in range(4):
            parts = [sl[s]["id"] for sl in slices]
            assert len(set(np.concatenate(parts).tolist())) == 16  # no example on two processes
            for p, part in enumerate(parts):  # process p holds rows [p·G/P, (p+1)·G/P)
                np.testing.assert_array_equal(part, whole[s]["id"][p * 16 // p_count:(p + 1) * 16 // p_count])


def test_an_epoch_visits_every_example_once_with_padding():
    it = make_batches(ids(103), 16, seed=5, drop_last=False, prefetch=0)
    assert it.steps_per_epoch == 7
    epoch = take(it, 7)
    real = np.concatenate([b["id"][b["mask"] == 1.0] for b in epoch])
    np.testing.assert_array_equal(np.sort(real), np.arange(103))
    assert (it.epoch, it.step) == (1, 0)


def test_an_epoch_visits_every_kept_example_once_without_padding():
    it = make_batches(ids(103), 16, seed=5)
    assert it.steps_per_epoch == 6
    seen = np.concatenate([b["id"] for b in take(it, 6)])
    assert len(seen) == 96 and len(np.unique(seen)) == 96
    assert all("mask" not in b for b in take(it, 3))


def test_every_epoch_has_a_new_order():
    it = make_batches(ids(64), 16, seed=0)
    epochs = [np.concatenate([b["id"] for b in take(it, 4)]) for _ in range(3)]
    for e in epochs:
        np.testing.assert_array_equal(np.sort(e), np.arange(64))
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    other_seed = np.concatenate([b["id"] for b in take(make_batches(ids(64), 16, seed=1), 4)])
    assert not np.array_equal(other_seed, epochs[0]) and not np.array_equal(other_seed, epochs[1])


def test_batches_follow_the_documented_order():
    # Global batch s of epoch e = examples epoch_order(seed, e, n)[s·G : (s+1)·G]; process p of P gets
    # its contiguous G/P rows, and positions past n wrap to the epoch's first examples (masked 0).
    n, g = 50, 16
    for p in range(2):
        it = make_batches(ids(n), g, seed=3, drop_last=False, process_index=p, num_processes=2)
        for epoch in range(2):
            order = epoch_order(3, epoch, n)
            np.testing.assert_array_equal(np.sort(order), np.arange(n))
            for step in range(4):
                positions = step * g + p * (g // 2) + np.arange(g // 2)
                batch = next(it)
                np.testing.assert_array_equal(batch["id"], order[positions % n])
                np.testing.assert_array_equal(batch["mask"], (positions < n).astype(np.float32))


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("stop", [3, 6, 7])  # mid-epoch, the last step of epoch 0, the first of epoch 1
def test_resume_continues_exactly(drop_last, stop):
    kw = dict(seed=7, drop_last=drop_last, process_index=1, num_processes=2)
    uninterrupted = take(make_batches(ids(100), 16, **kw), 16)
    it = make_batches(ids(100), 16, **kw)
    take(it, stop)
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    assert state["epoch"] * it.steps_per_epoch + state["step"] == stop
    resumed = make_batches(ids(100), 16, start_state=state, **kw)
    assert (resumed.epoch, resumed.step) == (it.epoch, it.step)
    assert_same_batches(take(resumed, 16 - stop), uninterrupted[stop:])
    fresh = make_batches(ids(100), 16, **kw)  # set_state on an iterator that already ran ahead
    take(fresh, 11)
    fresh.set_state(state)
    assert_same_batches(take(fresh, 16 - stop), uninterrupted[stop:])


def test_a_state_resumes_on_another_process_count():
    it = make_batches(ids(100), 16, seed=2, process_index=3, num_processes=4)
    take(it, 9)
    state = it.get_state()
    assert_same_batches(take(make_batches(ids(100), 16, seed=2, start_state=state), 5),
                        global_batches(100, 16, 4, 14, seed=2)[9:])


def test_prefetch_does_not_change_the_batches():
    assert_same_batches(take(make_batches(ids(50), 8, drop_last=False, prefetch=0), 15),
                        take(make_batches(ids(50), 8, drop_last=False, prefetch=4), 15))


def test_padding_and_mask_keep_the_weighted_mean_exact():
    values = np.random.default_rng(0).normal(size=10).astype(np.float32)
    it = make_batches({"v": values, "id": np.arange(10)}, 8, drop_last=False, num_processes=2, process_index=1)
    first, last = take(it, 2)
    assert first["mask"].dtype == np.float32 and first["mask"].shape == (4,)
    np.testing.assert_array_equal(first["mask"], 1.0)
    np.testing.assert_array_equal(last["mask"], 0.0)  # positions 12..15 of 10: all padding on process 1
    # On one process: the last global batch holds 2 real examples and 6 padding rows.
    batches = take(make_batches({"v": values}, 8, drop_last=False), 2)
    np.testing.assert_array_equal(batches[1]["mask"], [1, 1, 0, 0, 0, 0, 0, 0])
    assert np.isfinite(batches[1]["v"]).all()  # padding rows are real examples, so losses stay finite
    total = sum(float(np.sum(b["mask"] * b["v"])) for b in batches)
    count = sum(float(b["mask"].sum()) for b in batches)
    np.testing.assert_allclose(total / count, values.mean(), rtol=1e-6)


def test_a_dataset_smaller_than_one_batch_pads_when_drop_last_is_false():
    (batch,) = take(make_batches(ids(3), 8, drop_last=False), 1)
    np.testing.assert_array_equal(np.sort(batch["id"][batch["mask"] == 1]), [0, 1, 2])
    assert batch["mask"].sum() == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(data=ids(10), global_batch_size=16), r"has 10 examples, fewer than one global batch of 16 with drop_last"),
    (dict(data={"x": np.zeros(10), "y": np.zeros(9)}, global_batch_size=2), r"mismatched lengths .*'x': 10, 'y': 9"),
    (dict(data={"x": np.zeros((0, 3))}, global_batch_size=2), r"empty \(0 examples"),
    (dict(data={}, global_batch_size=2), r"non-empty dict of named arrays"),
    (dict(data={"x": np.array(1.0)}, global_batch_size=1), r"'x' is a scalar"),
    (dict(data=ids(64), global_batch_size=10, num_processes=4), r"global_batch_size=10 does not split evenly across "
                                                                r"num_processes=4; use a multiple of 4"),
    (dict(data=ids(64), global_batch_size=0), r"global_batch_size=0 must be an integer of at least 1"),
    (dict(data=ids(64), global_batch_size=8, num_processes=0), r"num_processes=0 must be an integer of at least 1"),
    (dict(data=ids(64), global_batch_size=8, num_processes=2, process_index=2),
     r"process_index=2 is out of range for num_processes=2; use an integer from 0 to 1"),
    (dict(data=ids(64), global_batch_size=8, process_index=-1), r"process_index=-1 is out of range"),
    (dict(data=ids(64), global_batch_size=8, seed=-1), r"seed=-1 must be an integer of at least 0"),
    (dict(data={"mask": np.ones(8)}, global_batch_size=4, drop_last=False), r"already has an array named 'mask'"),
])
def test_bad_input_raises_one_clear_sentence(kwargs, message):
    data = kwargs.pop("data")
    with pytest.raises(ValueError, match=message):
        make_batches(data, **kwargs)


def test_bad_states_are_refused():
    it = make_batches(ids(64), 16)
    state = it.get_state()
    with pytest.raises(ValueError, match=r"global_batch_size=8 but this iterator has global_batch_size=16"):
        it.set_state({**state, "global_batch_size": 8})
    with pytest.raises(ValueError, match=r"seed=1 but this iterator has seed=0"):
        it.set_state({**state, "seed": 1})
    with pytest.raises(ValueError, match=r"step=4 is out of range for 4 steps per epoch"):
        it.set_state({**state, "step": 4})
    with pytest.raises(ValueError, match=r"needs exactly the keys"):
        it.set_state({"epoch": 0})


def test_digits():
    x, y, xt, yt = load_digits()
    assert x.shape == (1438, 64) and xt.shape == (359, 64) and x.dtype == np.float32
    assert y.dtype == np.int32 and set(np.unique(y)) == set(range(10))
    assert 0.0 <= x.min() and x.max() <= 1.0
    xi, yi, xti, _ = load_digits(images=True)
    assert xi.shape == (1438, 8, 8, 1) and xti.shape == (359, 8, 8, 1)
    np.testing.assert_array_equal(xi.reshape(len(xi), 64), x)
    np.testing.assert_array_equal(yi, y)


def test_char_corpus():
    corpus = load_char_corpus()
    assert len(corpus.text) >= 100_000
    assert corpus.train.dtype == np.int32 and corpus.val.dtype == np.int32
    assert len(corpus.train) + len(corpus.val) == len(corpus.text)
    assert abs(len(corpus.val) / len(corpus.text) - 0.1) < 1e-3
    assert list(corpus.vocab) == sorted(set(corpus.text)) and corpus.vocab_size == len(corpus.vocab)
    assert corpus.decode(np.concatenate([corpus.train, corpus.val])) == corpus.text
    sample = corpus.text[1000:3000]
    np.testing.assert_array_equal(corpus.encode(sample), corpus.train[1000:3000])
    assert corpus.decode(corpus.encode(sample)) == sample
    with pytest.raises(ValueError, match=r"not in the corpus vocabulary"):
        corpus.encode("\x00")


def test_char_windows():
    tokens = np.arange(20, dtype=np.int32)
    w = char_windows(tokens, 5)
    assert len(w) == 15 and w.arrays["x"].shape == (15, 5) and w.arrays["x"].dtype == np.int32
    np.testing.assert_array_equal(w.arrays["x"][3], [3, 4, 5, 6, 7])
    np.testing.assert_array_equal(w.arrays["y"][3], [4, 5, 6, 7, 8])
    strided = char_windows(tokens, 5, stride=5)
    np.testing.assert_array_equal(strided.arrays["x"][:, 0], [0, 5, 10])
    np.testing.assert_array_equal(strided.arrays["y"][-1], [11, 12, 13, 14, 15])
    batch = next(make_batches(char_windows(load_char_corpus().train, 64), 32))
    assert batch["x"].shape == (32, 64) and (batch["x"][:, 1:] == batch["y"][:, :-1]).all()
    with pytest.raises(ValueError, match=r"too short for one window of context_length=20"):
        char_windows(tokens, 20)


def test_seed_regression():
    one, two = load_seed_regression(1), load_seed_regression(2)
    np.testing.assert_array_equal(one.arrays["x"], [2, 3, 1, 4])
    np.testing.assert_array_equal(one.arrays["t"], [3, 5, 2, 6])
    assert two.arrays["x"].shape == (8, 2) and two.arrays["t"].shape == (8,) and two.arrays["x"].dtype == np.float32
    # The seed numbers: one device's gradient -8.5 for w = 1; the mean gradient (-4.15, -3.85) for w = (0.5, -0.3).
    x, t = one.arrays["x"], one.arrays["t"]
    np.testing.assert_allclose(np.mean(2 * (x - t) * x), -8.5)
    x, t = two.arrays["x"], two.arrays["t"]
    np.testing.assert_allclose(2 * ((x @ [0.5, -0.3] - t)[:, None] * x).mean(0), [-4.15, -3.85], rtol=1e-6)
    with pytest.raises(ValueError, match=r"number=3 names no seed example; use 1 or 2"):
        load_seed_regression(3)


def test_load_arrays(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.ones((6, 2), np.float32), y=np.arange(6))
    d = load_arrays(tmp_path / "d.npz")
    assert isinstance(d, ArrayDataset) and len(d) == 6 and sorted(d.arrays) == ["x", "y"]
    np.save(tmp_path / "a.npy", np.arange(12).reshape(4, 3))
    a = load_arrays(tmp_path / "a.npy", key="tokens")
    assert a.arrays["tokens"].shape == (4, 3)
    assert next(make_batches(d, 2))["x"].shape == (2, 2)


def test_load_arrays_errors(tmp_path):
    with pytest.raises(ValueError, match=r"no such file: .*missing.npz"):
        load_arrays(tmp_path / "missing.npz")
    (tmp_path / "data.csv").write_text("1,2\n")
    with pytest.raises(ValueError, match=r"neither a .npz nor a .npy file"):
        load_arrays(tmp_path / "data.csv")
    objects = np.array([{"a": 1}, None], dtype=object)
    np.save(tmp_path / "obj.npy", objects, allow_pickle=True)
    with pytest.raises(ValueError, match=r"obj.npy' holds an object array 'x', which numpy stores as a pickle and "
                                         r"allow_pickle=False refuses to load"):
        load_arrays(tmp_path / "obj.npy")
    np.savez(tmp_path / "obj.npz", x=np.arange(2), o=objects)
    with pytest.raises(ValueError, match=r"obj.npz' holds an object array 'o'"):
        load_arrays(tmp_path / "obj.npz")
    (tmp_path / "pickle.npy").write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(ValueError, match=r"pickle.npy' is not a valid .npy file \(.*pickled"):
        load_arrays(tmp_path / "pickle.npy")
    np.savez(tmp_path / "ragged.npz", x=np.zeros(5), y=np.zeros(4))
    with pytest.raises(ValueError, match=r"ragged.npz': arrays have mismatched lengths \{'x': 5, 'y': 4\}"):
        load_arrays(tmp_path / "ragged.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip file")
    with pytest.raises(ValueError, match=r"junk.npz' is not a valid .npz file"):
        load_arrays(tmp_path / "junk.npz")
