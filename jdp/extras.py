"""jdp's optional dependencies (pyproject's extras): import one, or say in one sentence how to install it here.

jdp is published as `jdp-train` (the index's `jdp` is another project), so an installed wheel's
extra is `pip install 'jdp-train[plot]'`. In a source checkout (the Quick start's `pip install -e .`)
pip would read that as a request for the index's copy, so the command named is
`pip install -e '<checkout>[plot]'` there.
"""
from __future__ import annotations

import importlib
import os

DISTRIBUTION = "jdp-train"  # the name on the package index (pyproject's project.name); `import jdp` stays


def checkout() -> str | None:
    """The source checkout this jdp is imported from (the folder holding pyproject.toml), or None."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder that holds jdp/
    return root if os.path.isfile(os.path.join(root, "pyproject.toml")) else None


def install_command(extra: str) -> str:
    """The pip command that installs extra `extra` for the jdp imported here: in a source checkout
    `pip install -e '<checkout>[extra]'` ('.' when it is the working directory), else `pip install 'jdp-train[extra]'`."""
    root = checkout()
    if root is None:
        return f"pip install '{DISTRIBUTION}[{extra}]'"
    where = "." if os.path.realpath(os.getcwd()) == os.path.realpath(root) else root
    return f"pip install -e '{where}[{extra}]'"


def require(module: str, extra: str, what: str):
    """`import module`, or a ValueError naming the command that installs `extra` (what needs it: `what`)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{what} needs {module.split('.')[0]}, which is not installed here; install it with "
                         f"{install_command(extra)}") from None
