"""kill -9, SIGTERM (also during the last checkpoint write) and a second run on the workdir: no run
is lost, and every resume continues bit-exactly. One trial of each kind (the script runs 20)."""
from benchmarks.kill_trials import KINDS, run_trials


def test_interrupted_runs_resume_bit_exact_and_none_is_lost():
    result = run_trials(dict.fromkeys(KINDS, 1), steps=200, seed=1)
    assert result["trials"] == len(KINDS), result  # the run was really interrupted (it cannot finish 200 steps first)
    assert result["kills_during_write"] == 1 and result["sigterms_during_save"] >= 1, result
    # A kill before the first checkpoint restarts from scratch: at least one must resume for real.
    assert result["kills_after_checkpoint"] >= 1, result
    assert result["concurrent_refused"] == 1, result
    assert result["runs_lost"] == [], result
    assert result["steps_with_different_loss"] == 0 and result["final_params_bit_equal"], result
