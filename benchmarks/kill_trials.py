"""Interrupt `jdp train` in every way a job ends badly; every resume must be bit-exact, no run lost.

  python -m benchmarks.kill_trials --random 4 --during-write 4 --term 4 --term-during-save 4 --concurrent 4

One uninterrupted run is the reference. Then one run is interrupted again and again, each time
restarted with the same command, in a shuffled plan of trials:

- random / during-write: SIGKILL (no chance to clean up) at a random moment 0-2 s after the run
  holds the workdir (restoring, compiling, training, saving) and a complete checkpoint exists (a
  kill before the first one restarts from scratch, which proves nothing), or while orbax has a
  checkpoint write in flight (a new temporary directory exists).
- term: SIGTERM at a random moment 0-1.5 s after the run holds the workdir (restoring, compiling,
  training, saving, exiting), of an invocation of 40-100 steps without periodic checkpoints, so
  the checkpoint it stops with is all it keeps.
- term-during-save: SIGTERM again and again (every 0-30 ms) while the invocation's last
  checkpoint is being written, as `timeout` or a batch scheduler sends it at the end of a job.
- concurrent: a second run on the same workdir 0-3 s after the first: one of them must be refused
  (exit code 2, naming the other's pid); the other goes on until a SIGTERM.

After every trial: the newest complete checkpoint is no older than before it, a run that says it
stopped or finished has that checkpoint on disk, and a restart resumed from the newest one;
anything else counts as a lost run. At the end every logged loss and the final params must equal
the reference's, bit for bit.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks.common import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_env()
LOCK = ".jdp-lock"  # jdp.run.lock.LOCK_NAME, not imported: importing jdp loads jax, needed only at the end
KINDS = ("random", "during-write", "term", "term-during-save", "concurrent")


def command(workdir: str, steps: int, *, checkpoint_every: int = 1, stop_after: int | None = None) -> list[str]:
    """The `jdp train` command of every invocation (the run's identity never changes between them)."""
    return [sys.executable, "-m", "jdp.run.cli", "train", "--workdir", workdir, "--devices", "2", "--steps", str(steps),
            "--log-every", "1", "--no-progress", "--set", f"train.checkpoint_every={checkpoint_every}",
            "--set", "data.batch_size=64", "--set", "train.keep_checkpoints=2",
            *(["--stop-after", str(stop_after)] if stop_after else [])]


def last_losses(workdir: str) -> dict[int, float]:
    """The last logged loss of every step (a resumed run logs again the steps after its checkpoint)."""
    out = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():  # a kill can cut the last line short
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(r, dict) and "loss" in r:
                    out[r["step"]] = r["loss"]
    return out


def _entries(workdir: str) -> list[str]:
    ckpt = os.path.join(workdir, "checkpoints")
    return os.listdir(ckpt) if os.path.isdir(ckpt) else []


def newest(workdir: str) -> int:
    """The newest complete checkpoint's step (orbax renames a finished write to its step), 0 if none."""
    return max((int(d) for d in _entries(workdir) if d.isdigit()), default=0)


def temporaries(workdir: str) -> set[str]:
    """Checkpoint writes in flight (or left behind by a kill)."""
    return {d for d in _entries(workdir) if "tmp" in d}


class Invocation:
    """One `jdp train` process; its output goes to files (a full pipe would stall it)."""

    def __init__(self, argv: list[str], logs: str):
        self.out, self.err = tempfile.TemporaryFile("w+", dir=logs), tempfile.TemporaryFile("w+", dir=logs)
        self.proc = subprocess.Popen(argv, stdout=self.out, stderr=self.err, env=ENV, cwd=ROOT)
        self.pid, self.started = self.proc.pid, time.monotonic()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def finish(self, timeout: float = 180) -> tuple[int, str, str]:
        """(exit code, stdout, stderr); killed and TimeoutError if it has not ended within `timeout` s."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise TimeoutError(f"jdp train (pid {self.pid}) did not end within {timeout} s") from None
        texts = []
        for f in (self.out, self.err):
            f.seek(0)
            texts.append(f.read())
            f.close()
        return self.proc.returncode, *texts


def _wait_until(condition, run: Invocation, timeout: float = 180, poll: float = 0.02) -> bool:
    """Poll `condition()` while `run` lives; False once it has ended without it."""
    deadline = time.monotonic() + timeout
    while run.alive():
        if condition():
            return True
        if time.monotonic() > deadline:
            raise TimeoutError("the run neither ended nor reached the moment to interrupt it in time")
        time.sleep(poll)
    return False


def holds(workdir: str, run: Invocation) -> bool:
    """Whether `run` holds the workdir's lock (a kill -9 leaves a stale lock file naming another pid)."""
    try:
        with open(os.path.join(workdir, LOCK)) as f:
            return json.load(f).get("pid") == run.pid
    except (OSError, ValueError, AttributeError):
        return False


def trial_kill(workdir: str, steps: int, rng: random.Random, logs: str, during_write: bool) -> dict:
    """SIGKILL 0-2 s after the run holds the workdir and a checkpoint exists, or while a new write is in flight."""
    old, delay = temporaries(workdir), rng.uniform(0.0, 2.0)
    run = Invocation(command(workdir, steps), logs)
    if during_write:
        ready = _wait_until(lambda: bool(temporaries(workdir) - old), run, poll=0.002)
    else:
        ready = _wait_until(lambda: holds(workdir, run) and newest(workdir) > 0, run)
        since = time.monotonic()
        ready = ready and _wait_until(lambda: time.monotonic() - since > delay, run)
    had_checkpoint, in_save = newest(workdir) > 0, bool(temporaries(workdir) - old)  # read before the kill lands
    run.signal(signal.SIGKILL)
    code, out, err = run.finish()
    outcome = ("killed during a checkpoint write" if during_write else "killed") if ready else "completed"
    return {"outcome": outcome, "code": code, "out": out, "err": err, "after_checkpoint": ready and had_checkpoint,
            "during_save": ready and in_save, "codes": (-signal.SIGKILL,) if ready else (0,)}


def trial_term(workdir: str, steps: int, rng: random.Random, logs: str, during_save: bool) -> dict:
    """SIGTERM at a random moment once the run holds the workdir, or again and again during its last
    checkpoint write."""
    old, delay = temporaries(workdir), rng.uniform(0.0, 1.5)
    run = Invocation(command(workdir, steps, checkpoint_every=0,
                             stop_after=rng.randint(2, 12) if during_save else rng.randint(40, 100)), logs)
    if during_save:
        ready = _wait_until(lambda: bool(temporaries(workdir) - old), run, poll=0.002)
    else:
        ready = _wait_until(lambda: holds(workdir, run), run, poll=0.005)
        since = time.monotonic()
        ready = ready and _wait_until(lambda: time.monotonic() - since > delay, run)
    in_save = bool(temporaries(workdir) - old)
    signals = _term(run, lambda: during_save and bool(temporaries(workdir) - old), rng)
    code, out, err = run.finish()
    stopped = re.search(r"stopping at step (\d+) on SIGTERM", out)
    outcome = (f"SIGTERM stopped it at step {stopped.group(1)}" if stopped
               else "SIGTERM during its last checkpoint write" if ready and in_save
               else f"SIGTERM after its last step (exit code {code})" if ready else "completed")
    # Exit code -SIGTERM only from a random signal that came once train() had returned, everything
    # saved, outside jdp's handlers: never from one sent while a write was in flight.
    return {"outcome": outcome, "code": code, "out": out, "err": err, "during_save": ready and in_save,
            "term": ready, "signals": signals, "codes": (0, -signal.SIGTERM) if ready and not during_save else (0,)}


def _term(run: Invocation, writing, rng: random.Random) -> int:
    """SIGTERM once, then again every 0-30 ms while `writing()` (an impatient scheduler, or `timeout`
    sending again); the number sent. Each one after the first is sent only while the write is in
    flight (checked microseconds before), and jdp's cleanup after the write takes milliseconds: so
    every one reaches the process while its handlers must still be installed."""
    sent = 0
    while run.alive() and (sent == 0 or writing()):
        run.signal(signal.SIGTERM)
        sent += 1
        time.sleep(rng.uniform(0.0, 0.03))
    return sent


def trial_concurrent(workdir: str, steps: int, rng: random.Random, logs: str) -> dict:
    """Two runs on one workdir: one refused naming the other; the other goes on until a SIGTERM."""
    first = Invocation(command(workdir, steps), logs)
    time.sleep(rng.uniform(0.0, 3.0))
    second = Invocation(command(workdir, steps), logs)
    deadline = time.monotonic() + 180
    while first.alive() and second.alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    ended, other = (first, second) if not first.alive() else (second, first)
    code, _, err = ended.finish()
    time.sleep(rng.uniform(0.0, 1.5))
    other.signal(signal.SIGTERM)
    other_code, out, other_err = other.finish()
    refused = code == 2 and f"is in use by another run (pid {other.pid} on " in err and "Traceback" not in err
    problem = None if refused or code == 0 else f"the run that ended first: exit code {code}, {err[-300:]!r}"
    return {"outcome": f"the {'second' if ended is second else 'first'} run was refused" if refused
            else f"not refused (exit code {code})", "code": other_code, "out": out, "err": other_err,
            "refused": refused, "term": True, "codes": (0, -signal.SIGTERM), "problem": problem}


def lost(trial: dict, before: int, after: int) -> str | None:
    """Why this trial lost (part of) the run, or None."""
    out = trial["out"]
    if after < before:
        return f"the newest checkpoint went back from {before} to {after}"
    resumed = re.search(r"resumed from step (\d+)", out)
    if before and resumed and int(resumed.group(1)) != before:
        return f"resumed from step {resumed.group(1)}, not from the newest checkpoint {before}"
    said = re.search(r"stopping at step (\d+)", out) or re.search(r"(?:done|stopped) at step (\d+) of", out)
    if said and after != int(said.group(1)):
        return f"it said step {said.group(1)} was saved; the newest checkpoint is {after}"
    logged = [int(n) for n in re.findall(r"^step +(\d+) +loss", out, re.M)]
    if trial.get("term") and logged and after < max(logged):  # a SIGTERM must never cost a trained step
        return f"it trained step {max(logged)}, but after its SIGTERM the newest checkpoint is {after}"
    if trial["code"] not in trial["codes"]:
        return f"exit code {trial['code']}: {trial['err'][-300:]!r}"
    return trial.get("problem")


def run_trials(counts: dict, steps: int = 600, seed: int = 0) -> dict:
    """Run the reference, then the shuffled trials (`counts`: {kind: how many}), then the comparison."""
    rng = random.Random(seed)
    base = tempfile.mkdtemp(prefix="jdp-kill-")
    try:
        ref_dir, work = os.path.join(base, "reference"), os.path.join(base, "interrupted")
        subprocess.run(command(ref_dir, steps, checkpoint_every=0), check=True, capture_output=True, env=ENV,
                       cwd=ROOT, timeout=600)
        plan = [kind for kind in KINDS for _ in range(counts.get(kind, 0))]
        rng.shuffle(plan)
        trials = []
        for kind in plan:
            before = newest(work)
            if kind in ("random", "during-write"):
                trial = trial_kill(work, steps, rng, base, kind == "during-write")
            elif kind in ("term", "term-during-save"):
                trial = trial_term(work, steps, rng, base, kind == "term-during-save")
            else:
                trial = trial_concurrent(work, steps, rng, base)
            trial |= {"kind": kind, "lost": lost(trial, before, newest(work))}
            trials.append(trial)
            if newest(work) >= steps:
                break
        final = subprocess.run(command(work, steps, checkpoint_every=0), capture_output=True, text=True, env=ENV,
                               cwd=ROOT, timeout=600)
        if final.returncode != 0:
            raise RuntimeError(f"the final resume failed: {final.stderr[-2000:]}")
        return _summary(trials, steps, final.stdout, ref_dir, work)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _summary(trials: list[dict], steps: int, final_out: str, ref_dir: str, work: str) -> dict:
    resumed = re.search(r"resumed from step (\d+)", final_out)
    ref, got = last_losses(ref_dir), last_losses(work)

    def count(kind: str, key: str) -> int:
        return sum(t["kind"] == kind and bool(t.get(key)) for t in trials)

    return {
        "steps": steps, "trials": len(trials), "events": [f"{t['kind']}: {t['outcome']}" for t in trials],
        "kills": sum(t["outcome"].startswith("killed") for t in trials),
        "kills_during_write": sum(t["outcome"] == "killed during a checkpoint write" for t in trials),
        "kills_after_checkpoint": sum(bool(t.get("after_checkpoint")) for t in trials),
        "sigterms": sum(bool(t.get("term")) for t in trials),
        "sigterms_during_save": count("term-during-save", "during_save") + count("term", "during_save"),
        "concurrent_refused": count("concurrent", "refused"),
        "landed_during_save": sum(bool(t.get("during_save")) for t in trials),
        "runs_lost": [f"{t['kind']}: {t['lost']}" for t in trials if t["lost"]],
        "final_run_resumed_from": int(resumed.group(1)) if resumed else None,
        "steps_with_different_loss": len([s for s in ref if got.get(s) != ref[s]]),
        "final_params_bit_equal": _params(ref_dir) == _params(work),
    }


def _params(workdir: str) -> bytes:
    """The newest checkpoint's params, as raw bytes (bit-exact comparison)."""
    import jax
    import numpy as np

    from jdp.run.checkpoint import latest_params

    return b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(latest_params(workdir)[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for kind in KINDS:
        p.add_argument(f"--{kind}", type=int, default=4, metavar="N", help=f"{kind} trials (default 4)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    result = run_trials({kind: getattr(a, kind.replace("-", "_")) for kind in KINDS}, a.steps, a.seed)
    print(json.dumps(result, indent=1))
    ok = not result["runs_lost"] and result["steps_with_different_loss"] == 0 and result["final_params_bit_equal"]
    print("no run lost; every resume continued bit-exactly" if ok else "A RUN WAS LOST or a resume differs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
