"""How long the `jdp` command takes to answer `--version` and `--help`, as a whole process.

  python -m benchmarks.cli_startup [--runs 10]

The commands are the installed `jdp` script (pip's wrapper of the entry point, `jdp.run.entry:main`),
as a user runs them. Each runs `--runs` times after one warm-up; it prints the median and the
range of the wall times, and, as a yardstick measured in the same rounds, `python -c "import jax"`. Neither command
imports jax (`tests/test_cli_edges.py` asserts it), so both should stay far below that yardstick.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common import child_env

JDP = os.path.join(os.path.dirname(sys.executable), "jdp")
COMMANDS = {"jdp --version": [JDP, "--version"], "jdp --help": [JDP, "--help"],
            "jdp train --help": [JDP, "train", "--help"],
            "python -c 'import jax' (yardstick)": [sys.executable, "-c", "import jax"]}


def wall_times(commands: dict, runs: int) -> dict[str, list[float]]:
    """Seconds per run of each command, taken in rounds (every command once per round)."""
    env, times = child_env(), {name: [] for name in commands}
    for round_ in range(runs + 1):
        for name, argv in commands.items():
            t0 = time.perf_counter()
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True)
            if round_:  # the first round warms the file cache
                times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    for name, seconds in wall_times(COMMANDS, args.runs).items():
        print(f"{name:38s} median {statistics.median(seconds):6.3f} s  (min {min(seconds):.3f}, "
              f"max {max(seconds):.3f}, {len(seconds)} runs)")


if __name__ == "__main__":
    main()
