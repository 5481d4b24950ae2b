"""When a Ctrl-C can still make the `jdp` command print a traceback: SIGINT after d ms, swept.

  python -m benchmarks.cli_interrupt [--trials 20] [--delays 0,2,5,...] [--commands version,help,train]
  python -m benchmarks.cli_interrupt --entry jdp.run.cli     # the entry point before jdp.run.entry

Each command (the installed `jdp` script, as a user runs it) is started `--trials` times per delay;
d ms after it starts (after its exec) it is sent SIGINT. Each outcome is counted as one of:

- `done`: it finished first (exit 0, no traceback);
- `line+130`: jdp's one line ("jdp: interrupted (Ctrl-C); ...") and exit code 130;
- `killed`: killed by the signal itself (status -2, no traceback): before Python set up its own
  handler, or after its shutdown has put the default action back (the command's output is then complete);
- `tb-python`: a KeyboardInterrupt traceback raised in Python's own start-up, before the `jdp`
  script's first line ("Fatal Python error: ..." while it sets up its streams or imports `site`,
  "failed to set __main__.__loader__", or "Failed checking if argv[0] is an import path entry",
  after which Python ignores it and runs the script: then `hung` for a run);
- `tb-jdp`: any other traceback or KeyboardInterrupt: raised in the `jdp` script, in jdp's code or
  in what it imports (or ignored there, "Exception ignored in", and then `hung` if the run went on);
- `hung`: still running `timeout_s` after the signal (the signal was lost), then killed;
- `other`: anything else, printed once with its output.

Below each table, the tracebacks by where they were raised: Python's start-up, or the `jdp`
script's line (pip writes it: line 3 `import re`, 5 `from jdp.run.entry import main`, 7 `re.sub`
of argv[0], 8 `sys.exit(main())`) and jdp's innermost module, if any. `--entry MODULE` runs a
copy of the script that imports `main` from MODULE instead (`jdp.run.cli`: the entry point before
the handler moved to `jdp.run.entry`).

The commands run without PYTHONDONTWRITEBYTECODE, as a user's do: jdp's modules load from their
cached bytecode (a wheel install writes it; an editable install on first use). The delays are
rounds: every delay once per round, so the machine's load spreads over all of them. It also prints
the median wall time of a whole `python -S -c pass`, `python -c pass` and `python -c "import re,
sys"` (the interpreter's own start-up and pip's script's first import, before any jdp code runs).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import child_env

JDP = os.path.join(os.path.dirname(sys.executable), "jdp")
LINE = "jdp: interrupted (Ctrl-C); a run's checkpoints already saved are intact.\n"
DELAYS = (0, 2, 5, 10, 15, 20, 30, 40, 50, 60, 80, 100, 150, 200, 300)
OUTCOMES = ("done", "line+130", "killed", "tb-python", "tb-jdp", "hung", "other")
# What Python prints when a KeyboardInterrupt stops its own start-up, before the script runs.
START_UP = {"Fatal Python error: init_sys_streams": "sets up sys.stdin/stdout/stderr",
            "Fatal Python error: init_import_site": "imports site (and the .pth files)",
            "failed to set __main__.__loader__": "sets up __main__",
            "argv[0] is an import path entry": "checks argv[0] (the KeyboardInterrupt is then ignored)"}


def commands(script: str, workdir: str) -> dict[str, list[str]]:
    """The commands swept: two that answer at once and a run that trains for minutes."""
    return {"version": [script, "--version"], "help": [script, "train", "--help"],
            "train": [script, "train", "--workdir", os.path.join(workdir, "w"), "--steps", "100000", "--no-progress"]}


def outcome(returncode: int, out: str, err: str) -> str:
    """One of OUTCOMES for a finished process."""
    if "Traceback" in out + err or "KeyboardInterrupt" in err:
        return "tb-python" if any(marker in err for marker in START_UP) else "tb-jdp"
    if returncode == 0 and not err:
        return "done"
    if returncode == 130 and err == LINE:
        return "line+130"
    if returncode == -signal.SIGINT and not err:
        return "killed"
    return "other"


def raised_where(script: str, output: str) -> str:
    """Where a traceback was raised: the script's innermost line and jdp's innermost module, or
    Python's start-up."""
    for marker, phase in START_UP.items():
        if marker in output:
            return f"Python's start-up: while it {phase}"
    frames = re.findall(r'File "([^"]+)", line (\d+)', output)
    lines = [line for path, line in frames if path == script]
    modules = [path.split(os.sep + "jdp" + os.sep, 1)[1] for path, _ in frames if os.sep + "jdp" + os.sep in path]
    return (f"script line {lines[-1]}" if lines else "no script frame") + (f", in jdp/{modules[-1]}" if modules else "")


def interrupt_after(argv: list[str], delay_ms: float, env: dict, timeout_s: float = 60) -> tuple[str, str]:
    """Start argv, send SIGINT after delay_ms (unless it has finished), classify; the outcome and its output."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    time.sleep(delay_ms / 1000)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:  # the signal was lost: stop it, and say what it printed
        proc.kill()
        out, err = proc.communicate()
        return "hung", f"still running after {timeout_s} s\n{out}{err}"
    return outcome(proc.returncode, out, err), f"exit {proc.returncode}\n{out}{err}"


def start_up_seconds(runs: int, env: dict) -> dict[str, float]:
    """Median wall seconds of the interpreter's start-up alone, with and without site, and the script's first line."""
    argvs = {"python -S -c pass": [sys.executable, "-S", "-c", "pass"],
             "python -c pass": [sys.executable, "-c", "pass"],
             "python -c 'import re, sys'": [sys.executable, "-c", "import re, sys"]}
    times = collections.defaultdict(list)
    for _ in range(runs):
        for name, argv in argvs.items():
            t0 = time.perf_counter()
            subprocess.run(argv, env=env, check=True)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def script_for(entry: str | None, folder: str) -> str:
    """The installed `jdp` script, or a copy of it in `folder` that imports `main` from `entry`."""
    if entry is None:
        return JDP
    with open(JDP) as f:
        text, n = re.subn(r"^from [\w.]+ import main$", f"from {entry} import main", f.read(), flags=re.M)
    if n != 1:
        raise SystemExit(f"{JDP} has no line 'from ... import main' to replace")
    path = os.path.join(folder, "jdp")
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    return path


def sweep(argv: list[str], script: str, delays: list[float], trials: int, env: dict) -> None:
    """Print the table of outcomes per delay, then where the tracebacks were raised."""
    counts = {d: collections.Counter() for d in delays}
    where, shown = collections.Counter(), set()
    for _ in range(trials):
        for d in delays:
            kind, output = interrupt_after(argv, d, env)
            counts[d][kind] += 1
            if kind in ("tb-python", "tb-jdp", "hung"):
                where[f"{kind}: {raised_where(script, output)}"] += 1
            if kind in ("other", "hung") and kind not in shown:
                shown.add(kind)
                print(f"-- {d:g} ms, {kind}:\n{output[-1500:]}")
    print(f"\n{' '.join(['jdp', *argv[1:]])}: {trials} trials per delay")
    print(f"{'delay ms':>9s} " + " ".join(f"{k:>9s}" for k in OUTCOMES))
    for d in delays:
        print(f"{d:9g} " + " ".join(f"{counts[d][k]:9d}" for k in OUTCOMES))
    for place, n in where.most_common():
        print(f"  {n:4d}  {place}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--delays", default=",".join(map(str, DELAYS)), help="milliseconds, comma-separated")
    parser.add_argument("--commands", default="version,help,train")
    parser.add_argument("--entry", help="run a copy of the jdp script that imports main from this module")
    args = parser.parse_args()
    delays = [float(d) for d in args.delays.split(",")]
    env = child_env("PYTHONDONTWRITEBYTECODE")
    for name, seconds in start_up_seconds(10, env).items():
        print(f"{name:30s} median {seconds * 1000:6.1f} ms")
    with tempfile.TemporaryDirectory() as folder:
        script = script_for(args.entry, folder)
        subprocess.run([script, "--version"], env=env, check=True, capture_output=True)  # writes the bytecode
        for name in args.commands.split(","):
            sweep(commands(script, folder)[name], script, delays, args.trials, env)


if __name__ == "__main__":
    main()
