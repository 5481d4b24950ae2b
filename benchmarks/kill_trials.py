"""Kill -9 `jdp train` at random moments and during checkpoint writes; every resume must be bit-exact.

  python -m benchmarks.kill_trials --random 6 --during-write 6

One uninterrupted run is the reference. Then one run is killed (SIGKILL, no chance to clean up)
again and again, each time restarted with the same command, until it completes: at random
moments, and at moments when orbax has a checkpoint write in flight (its temporary directory
exists). Random kills wait for the first complete checkpoint: a run killed before it restarts
from scratch, which proves nothing about resuming. At the end every logged loss and the final
params must equal the reference's exactly.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC", "NPROC")}


def command(workdir: str, steps: int) -> list[str]:
    return [sys.executable, "-m", "jdp.cli", "train", "--workdir", workdir, "--devices", "2", "--steps", str(steps),
            "--log-every", "1", "--checkpoint-every", "1", "--no-progress", "--set", "data.batch_size=64",
            "--set", "train.keep_checkpoints=2"]


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
                if "loss" in r:
                    out[r["step"]] = r["loss"]
    return out


def writing(workdir: str) -> bool:
    ckpt = os.path.join(workdir, "checkpoints")
    return os.path.isdir(ckpt) and any("tmp" in d for d in os.listdir(ckpt))


def checkpointed(workdir: str) -> bool:
    """A complete checkpoint exists (orbax renames a finished write to its step number)."""
    ckpt = os.path.join(workdir, "checkpoints")
    return os.path.isdir(ckpt) and any(d.isdigit() for d in os.listdir(ckpt))


def kill_once(workdir: str, steps: int, during_write: bool, rng: random.Random, timeout: float = 120) -> tuple[str, bool]:
    """Start the run, SIGKILL it at a random moment after a checkpoint exists (or mid-write).

    Returns what happened, and whether a complete checkpoint existed when the kill landed.
    """
    proc = subprocess.Popen(command(workdir, steps), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=ENV, cwd=ROOT)
    deadline = time.monotonic() + timeout
    delay, since = rng.uniform(0.0, 2.0), None  # seconds after the first complete checkpoint
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return "completed", checkpointed(workdir)
            if since is None and checkpointed(workdir):
                since = time.monotonic()
            ready = during_write or (since is not None and time.monotonic() - since > delay)
            if ready and (not during_write or writing(workdir)):
                had_checkpoint = checkpointed(workdir)  # read before the kill: the kill can land mid-rename
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
                return ("killed during a checkpoint write" if during_write else "killed"), had_checkpoint
            time.sleep(0.002 if during_write else 0.05)
        raise TimeoutError("the run neither finished nor reached a kill point in time")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def run_trials(n_random: int, n_during_write: int, steps: int = 120, seed: int = 0) -> dict:
    rng = random.Random(seed)
    base = tempfile.mkdtemp(prefix="jdp-kill-")
    try:
        ref_dir = os.path.join(base, "reference")
        subprocess.run(command(ref_dir, steps), check=True, capture_output=True, env=ENV, cwd=ROOT, timeout=600)
        work = os.path.join(base, "killed")
        plan = ["random"] * n_random + ["write"] * n_during_write
        rng.shuffle(plan)
        events, after_checkpoint = [], []
        for kind in plan:
            event, had_checkpoint = kill_once(work, steps, kind == "write", rng)
            events.append(event)
            after_checkpoint.append(event.startswith("killed") and had_checkpoint)
            if event == "completed":
                break
        final = subprocess.run(command(work, steps), capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
        if final.returncode != 0:
            raise RuntimeError(f"the final resume failed: {final.stderr[-2000:]}")
        resumed = re.search(r"resumed from step (\d+)", final.stdout)
        ref, got = last_losses(ref_dir), last_losses(work)
        mismatched = [s for s in ref if got.get(s) != ref[s]]
        params_equal = _params(ref_dir) == _params(work)
        return {"steps": steps, "events": events, "kills": sum(e.startswith("killed") for e in events),
                "kills_during_write": sum(e == "killed during a checkpoint write" for e in events),
                "kills_after_checkpoint": sum(after_checkpoint),
                "final_run_resumed_from": int(resumed.group(1)) if resumed else None,
                "steps_with_different_loss": len(mismatched), "final_params_bit_equal": params_equal}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _params(workdir: str) -> bytes:
    """The newest checkpoint's params, as raw bytes (bit-exact comparison)."""
    import jax
    import numpy as np

    from jdp.checkpoint import latest_params

    return b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(latest_params(workdir)[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--random", type=int, default=6)
    p.add_argument("--during-write", type=int, default=6)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    result = run_trials(a.random, a.during_write, a.steps, a.seed)
    print(json.dumps(result, indent=1))
    ok = result["steps_with_different_loss"] == 0 and result["final_params_bit_equal"]
    print("every resume continued bit-exactly" if ok else "MISMATCH after a resume")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
