"""kill -9 at random moments and during checkpoint writes: every resume continues bit-exactly."""
from benchmarks.kill_trials import run_trials


def test_kills_then_resume_bit_exact():
    result = run_trials(n_random=1, n_during_write=1, steps=200, seed=1)
    assert result["kills"] >= 2, result  # the run was really interrupted (it cannot finish 200 steps first)
    assert result["kills_during_write"] >= 1, result
    # A kill before the first checkpoint restarts from scratch: at least one must resume for real.
    assert result["kills_after_checkpoint"] >= 1, result
    assert result["steps_with_different_loss"] == 0 and result["final_params_bit_equal"], result
