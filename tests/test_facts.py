"""A run's facts (`jdp.run.facts.RunFacts`): computed once from the config, read by the loop, the
checkpoints and the agreement between processes. Cheap: no step is compiled."""
import jax
import numpy as np
import pytest

from jdp.config import HASH_EXCLUDED, config_hash, load_config, run_identity
from jdp.data import ArrayDataset
from jdp.run import distributed
from jdp.run.checkpoint import CheckpointMismatchError, with_data_digest
from jdp.run.facts import RunFacts
from jdp.train import schedule_facts


def test_the_facts_hold_the_identity_the_hash_and_what_processes_agree_on():
    config = load_config(None, ["train.steps=20", "train.log_every=5", "train.checkpoint_every=4"])
    facts = RunFacts.of(config, jax.devices()[:2], stop_after=3)
    assert facts.identity == run_identity(config) and facts.config_hash == config_hash(config)
    assert facts.agreed["config"] == facts.config_hash
    assert {*HASH_EXCLUDED, "train.steps", "stop_after", "devices", "local devices"} <= facts.agreed.keys()
    assert (facts.agreed["train.checkpoint_every"], facts.agreed["stop_after"], facts.agreed["devices"]) == (4, 3, 2)
    assert schedule_facts(config, jax.devices()[:2], stop_after=3) == facts.agreed
    assert facts.checkpoint_run() == {"identity": facts.identity, "config": config.to_dict(), "devices": 2}


def test_one_rule_says_which_steps_log_evaluate_and_checkpoint():
    config = load_config(None, ["train.steps=12", "train.log_every=5", "train.eval_every=0",
                                "train.checkpoint_every=4"])
    facts = RunFacts.of(config, jax.devices()[:1])
    end = 10  # a run stopped early (--stop-after) acts at its own last step too
    assert [s for s in range(1, end + 1) if facts.logs_at(s, end)] == [5, 10]
    assert [s for s in range(1, end + 1) if facts.evaluates_at(s, end)] == [10]
    assert [s for s in range(1, end + 1) if facts.checkpoints_at(s, end)] == [4, 8, 10]
    assert facts.stop_check_every(1) == 1 and facts.stop_check_every(2) == 5


@pytest.mark.parametrize("flags", [(False, False, True), (False, True, False), (True, False, False),
                                   (False, False, False)])
def test_a_stop_asked_by_any_one_process_is_every_process_decision(monkeypatch, flags):
    # Three processes' stop requests as the all-gather returns them (a real two-process SIGTERM is in
    # tests/test_multiprocess.py): each process, whatever its own flag, decides what all of them do.
    monkeypatch.setattr(distributed.jax, "process_count", lambda: len(flags))
    for me, mine in enumerate(flags):
        rows = np.array([[f] for f in flags], np.int32)
        monkeypatch.setattr(distributed, "_gather", lambda values, rows=rows, me=me: (
            np.testing.assert_array_equal(values, rows[me]), rows)[1])
        assert distributed.any_process(mine) is any(flags)


def test_the_data_joins_the_identity_and_the_agreed_sizes_and_digests():
    arrays = ArrayDataset({"x": np.arange(12, dtype=np.float32).reshape(6, 2), "y": np.arange(6)})
    facts = RunFacts.of(load_config(None), jax.devices()[:1]).with_data(arrays, ArrayDataset({"x": np.zeros((2, 2))}))
    assert facts.identity == with_data_digest(run_identity(load_config(None)), arrays)
    held_out = with_data_digest({}, ArrayDataset({"x": np.zeros((2, 2))}))["data"]["train_arrays_sha256"]
    assert facts.data_facts() == {"train_examples": 6, "test_examples": 2,
                                  "the training data's digest": facts.identity["data"]["train_arrays_sha256"],
                                  "the held-out data's digest": held_out}
    named = RunFacts.of(load_config(None), jax.devices()[:1]).with_data(arrays, paths=("a/train.bin", None))
    assert named.data_facts()["the training data's digest (read from 'a/train.bin')"] == facts.identity["data"][
        "train_arrays_sha256"] and named.data_facts()["the held-out data's digest"] is None
    assert facts.config_hash == config_hash(load_config(None))  # the hash stays the config's
    seeded = RunFacts.of(load_config(None, ["train.seed=7"]), jax.devices()[:1]).agreed
    assert seeded["train.seed"] == 7 and seeded["optim.lr"] == load_config(None).optim.lr  # fields, named on a refusal


@pytest.mark.parametrize("schedule, refused", [("cosine", True), ("constant", False)])
def test_a_change_of_train_steps_is_refused_only_where_the_schedule_uses_it(schedule, refused):
    saved = RunFacts.of(load_config(None, [f"optim.schedule={schedule}", "train.steps=10"])).identity
    facts = RunFacts.of(load_config(None, [f"optim.schedule={schedule}", "train.steps=20"]))
    if refused:
        with pytest.raises(CheckpointMismatchError, match=r"train.steps=20 differs from the run's 10 in 'w'"):
            facts.compared_with(saved, "w")
    else:
        assert facts.compared_with(saved, "w")["identity"] == saved  # a constant schedule extends the run


def _agree_as_two_processes(monkeypatch, *facts):
    """`distributed.agree(facts[i])` run as process i of 2, each in its own thread, their gathers exchanged
    in memory: each returns every process's array, stacked in process order. What each raised (or None)."""
    import threading

    barrier, slots, who = threading.Barrier(2, timeout=300), {}, threading.local()  # a hang guard only

    def gather(values):
        slots[who.i] = np.asarray(values)
        barrier.wait()
        out = np.stack([slots[0], slots[1]])
        barrier.wait()
        return out

    def process(i):
        who.i = i
        try:
            distributed.agree(facts[i])
        except ValueError as e:
            raised[i] = e

    monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed, "_gather", gather)
    raised = [None, None]
    threads = [threading.Thread(target=process, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return raised


def test_processes_whose_data_digests_differ_are_refused_naming_both(monkeypatch):
    # Two hosts' copies of train.bin of one size: their facts differ only in a digest of the same length
    key = "the training data's digest (read from 'train.bin')"
    mine, theirs = {"train_examples": 4991, key: "b08afc2444de9c70"}, {"train_examples": 4991, key: "c5a028712627e0cb"}
    assert _agree_as_two_processes(monkeypatch, mine, dict(mine)) == [None, None]  # equal facts: nothing to say
    raised = _agree_as_two_processes(monkeypatch, mine, theirs)
    assert [str(e) for e in raised] == [
        f"the 2 processes disagree about the run ({key}: process 0 'b08afc2444de9c70', process 1 "
        "'c5a028712627e0cb'); start them all with the same config and data."] * 2
