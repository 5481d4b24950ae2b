"""The `jdp` command's entry point (`[project.scripts]` in pyproject.toml): Ctrl-C is quiet from
the first line of jdp's code that the command runs.

pip's `jdp` script runs `from jdp.run.entry import main` and `sys.exit(main())`. `main` installs
the SIGINT handler that ends a Ctrl-C with one line and exit code 130 (`jdp.run.exits`), and only
then imports the command line (argparse, subprocess, the subcommands: ~25 ms). A Ctrl-C during
those imports used to print Python's KeyboardInterrupt traceback or, raised inside a callback of
the import system, be "ignored" while `jdp train` went on training. What still runs before the
handler: Python's own start-up, the script's `import re`, and `import jdp` (`benchmarks/cli_interrupt.py`
measures each). `import jdp` itself leaves signals alone: code that imports jdp keeps Python's
KeyboardInterrupt.
"""
from __future__ import annotations

import sys

from jdp.run.exits import quiet_interrupts


def main(argv: list[str] | None = None) -> int:
    """`jdp ARGS`' exit code (`jdp.run.cli.main`), with the quiet SIGINT handler installed first. The
    handler stays installed after it returns, while the script exits: a Ctrl-C between the return
    and the exit would otherwise be a traceback. In-process, call `jdp.run.cli.main`, which
    restores the caller's handler."""
    quiet_interrupts()
    from jdp.run.cli import main as run  # the command line's imports, now under the handler

    return run(argv)


if __name__ == "__main__":  # python -m jdp.run.entry: as the jdp script
    sys.exit(main())
