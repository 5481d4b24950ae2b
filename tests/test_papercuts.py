"""What a newcomer meets in the first hour: `jdp --version`, a script beside a clone named jdp/,
`jdp plot` without matplotlib, the plot's labels, `jdp explain` in 80 columns, the console's
global-batch line."""
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv

import jax
import pytest
from rich.console import Console

import jdp
import jdp.cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        jdp.cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"jdp {jdp.__version__}\n"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]  # one source: jdp.__version__
    from importlib.metadata import version

    assert version("jdp") == jdp.__version__  # what the installed metadata says


def test_a_script_beside_a_clone_named_jdp_imports_the_installed_package(tmp_path):
    """`git clone` names the checkout jdp/; after `pip install -e jdp`, a script in the folder that
    holds the clone must import the package jdp/jdp/, not the checkout as a namespace package.

    A fresh venv (so this environment's own editable install is left alone) sees the installed
    dependencies through a .pth line; pip builds the editable wheel as a user's `pip install -e`
    does (build isolation: it fetches setuptools), ~15 s.
    """
    clone = tmp_path / "jdp"  # what the build reads: pyproject.toml, README.md, the package
    clone.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, clone / name)
    shutil.copytree(ROOT / "jdp", clone / "jdp", ignore=shutil.ignore_patterns("__pycache__"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    pip = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "-e", str(clone)], capture_output=True,
                         text=True, timeout=600, cwd=tmp_path, env=env)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    pathlib.Path(purelib, "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (tmp_path / "use_jdp.py").write_text("import jdp\nprint(jdp.__file__)\nprint(jdp.cpu.__name__)\n")
    run = subprocess.run([python, "use_jdp.py"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**env, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [str(clone / "jdp" / "__init__.py"), "jdp.cpu"]
