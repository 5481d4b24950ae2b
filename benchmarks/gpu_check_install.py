"""benchmarks/gpu_check.sh's install step: what jdp needs (pyproject.toml's dependencies, and the bench
extra's tokenizers), installed only where missing, never over the jax already there.

    python -m benchmarks.gpu_check_install           # prints one line: what was there, what it installed
    python -m benchmarks.gpu_check_install --check   # the same line, installs nothing

A GPU machine's image brings its own CUDA jax, jaxlib and plugins (and torch): `pip install -e .`
would let pip re-resolve them. So only the missing requirements are installed, with every installed
jax*, nvidia-*, numpy, ml-dtypes and torch pinned to its present version (a pip constraints file),
from wheels in .whl/ (a machine with no network; --no-index) or else from the index. jdp itself is
imported from the checkout (PYTHONPATH), as the check runs it.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from importlib import metadata

from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PINNED = re.compile(r"^(jax|jaxlib|jax-.*|nvidia-.*|numpy|ml-dtypes|torch|triton)$")
BENCH_EXTRA = ("tiktoken", "tokenizers")  # of [bench]: torch is the image's own (its CUDA build)


def requirements() -> list[Requirement]:
    """pyproject.toml's dependencies, and the bench extra's tokenizers (the decode and side-by-side parts)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    bench = [r for r in project["optional-dependencies"]["bench"] if Requirement(r).name in BENCH_EXTRA]
    return [Requirement(r) for r in project["dependencies"] + bench]


def missing(reqs: list[Requirement]) -> tuple[list[Requirement], list[str]]:
    """(requirements not installed at all, "NAME VERSION below SPEC" for those installed too old: kept,
    since replacing e.g. the image's jax would drop its CUDA plugin's match)."""
    absent, old = [], []
    for r in reqs:
        try:
            have = metadata.version(r.name)
        except metadata.PackageNotFoundError:
            absent.append(r)
            continue
        if r.specifier and not r.specifier.contains(have, prereleases=True):
            old.append(f"{r.name} {have} below {r.specifier}")
    return absent, old


def constraints() -> str:
    """`NAME==VERSION` lines for every installed package pip must leave alone (PINNED)."""
    seen = {}
    for d in metadata.distributions():
        name = (d.metadata["Name"] or "").lower()
        if PINNED.match(name):
            seen[name] = d.version
    return "".join(f"{n}=={v}\n" for n, v in sorted(seen.items()))


def install(absent: list[Requirement]) -> str:
    """pip-install `absent` under the constraints; one line saying how it went."""
    wheels = os.path.join(ROOT, ".whl")
    source = ["--no-index", "--find-links", wheels] if os.path.isdir(wheels) else ["--retries", "0", "--timeout", "15"]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(constraints())
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir", "-c", f.name, *source, *map(str, absent)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    os.unlink(f.name)
    where = "wheels in .whl/" if os.path.isdir(wheels) else "the package index"
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return f"FAILED to install {', '.join(map(str, absent))} from {where} (pip exit {r.returncode}: {last[:200]})"
    return f"installed {', '.join(map(str, absent))} from {where}, jax and the CUDA packages pinned as found"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="say what is missing, install nothing")
    args = ap.parse_args(argv)
    absent, old = missing(requirements())
    note = f"; older than jdp asks, kept: {', '.join(old)}" if old else ""
    if not absent:
        print(f"nothing to install: jdp's requirements are all there{note}")
    elif args.check:
        print(f"missing, not installed (--check): {', '.join(map(str, absent))}{note}")
    else:
        print(install(absent) + note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
