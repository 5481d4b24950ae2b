"""jdp as a user installs it: the wheel, in a fresh venv, used from another directory.

The wheel is built from a copy of the package's sources (`pip wheel --no-deps --no-build-isolation`:
no download; the build needs setuptools 77+, which the `test` extra installs) and installed with
the `plot` extra into a new venv by pip, offline: the new venv sees this environment's installed
packages through a `.pth` line (its dependencies are then already there), but not the checkout,
whose editable install's own `.pth` is not processed there. Every command then runs in an empty
folder with no checkout on the path. Full tier only (about a minute).
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import venv

import pytest

from benchmarks.common import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.xdist_group("test_wheel")


def _run(argv, cwd, env, timeout=600):
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{argv}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(bin folder of a fresh venv holding the jdp-train wheel with its plot extra, an empty work folder, env)."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    for name in ("jdp", "pyproject.toml", "README.md"):  # what the build reads, nothing else of the checkout
        copy = shutil.copytree if os.path.isdir(os.path.join(ROOT, name)) else shutil.copy
        copy(os.path.join(ROOT, name), src / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                                      if copy is shutil.copytree else {}))
    env = {k: v for k, v in child_env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(base / "dist"),
          str(src)], cwd=base, env=env)
    (wheel,) = os.listdir(base / "dist")
    assert wheel.startswith("jdp_train-") and wheel.endswith("-py3-none-any.whl"), wheel
    target = base / "venv"
    venv.create(target, with_pip=False)
    purelib = sysconfig.get_path("purelib", vars={"base": str(target), "platbase": str(target)})
    with open(os.path.join(purelib, "_this_environment.pth"), "w") as f:
        f.write(sysconfig.get_path("purelib") + "\n")  # a path line: that folder's own .pth files are not run
    python = str(target / "bin" / "python")
    # This environment's editable jdp-train is visible through the path line: install the wheel over
    # it in the new venv's own folder first, or pip would take it as installed already.
    for args in (["--ignore-installed", "--no-deps", "jdp-train"], ["jdp-train[plot]"]):
        _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index", "--find-links",
              str(base / "dist"), *args], cwd=base, env=env)
    work = base / "elsewhere"
    work.mkdir()
    return target / "bin", work, env


def test_the_installed_wheel_imports_its_own_copy_and_names_its_extras(installed):
    bin_dir, work, env = installed
    out = _run([str(bin_dir / "python"), "-c", "import jdp, jdp.extras; print(jdp.__file__); "
                "print(jdp.extras.install_command('plot'))"], cwd=work, env=env)
    where, hint = out.splitlines()
    assert where.startswith(str(bin_dir.parent)) and not where.startswith(ROOT), where
    assert hint == "pip install 'jdp-train[plot]'"
    assert _run([str(bin_dir / "jdp"), "--version"], cwd=work, env=env).startswith("jdp 0.")


def test_the_commands_work_from_another_directory(installed):
    bin_dir, work, env = installed
    jdp = str(bin_dir / "jdp")
    listing = _run([jdp, "configs"], cwd=work, env=env)
    assert "char_gpt: " in listing and "expected: held-out character accuracy" in listing
    out = _run([jdp, "train", "--no-progress"], cwd=work, env=env)  # the default: the digits MLP, 300 steps
    assert "done at step 300 of 300" in out and "held-out accuracy 0.9" in out, out
    # A 20-step run of a 400-step config: its 40 warmup steps become 2, said in one line
    out = _run([jdp, "train", "char_gpt", "--steps", "20", "--no-progress"], cwd=work, env=env)
    assert out.startswith("optim.warmup_steps 40 -> 2: --steps 20 keeps the config's warmup fraction (40 of 400 "
                          "steps)\n"), out
    assert "done at step 20 of 20" in out and "workdir runs/char_gpt" in out, out
    out = _run([jdp, "data", "prepare-tokens", "python-reference", "tokens"], cwd=work, env=env)
    assert "train.bin: " in out and (work / "tokens" / "val.bin").stat().st_size > 0
    out = _run([jdp, "plot", "runs/digits_mlp"], cwd=work, env=env)
    assert (work / "runs" / "digits_mlp" / "curves.png").read_bytes()[:4] == b"\x89PNG", out


def _example_pointers() -> tuple[set[str], set[str]]:
    """What the pages send a user to among the examples: the modules they run (`python -m jdp.examples.NAME`,
    `--pyargs jdp.examples.NAME`) and the files they name (`jdp/examples/NAME.py`, a launch script)."""
    import re

    from console_quotes import pages, read

    text = "\n".join(read(page) for page in pages())
    modules = set(re.findall(r"(?:python -m|--pyargs) (jdp\.examples(?:\.[a-z_]\w*)?)", text))  # NAME: a placeholder
    files = set(re.findall(r"jdp/examples/(\w+\.(?:py|sh))", text)) | set(re.findall(r"`(launch_\w+\.sh)`", text))
    return modules, files


def test_the_examples_the_pages_point_at_ship_in_the_wheel(installed):
    """Every `python -m jdp.examples.NAME` and every file of jdp/examples/ a page names is in the installed
    wheel; one of them runs there, and `python -m jdp.examples` lists the folder that holds them."""
    bin_dir, work, env = installed
    modules, files = _example_pointers()
    assert {"jdp.examples", "jdp.examples.seed_demo", "jdp.examples.test_my_model"} <= modules, modules
    assert {"launch_local.sh", "launch_slurm.sh", "test_my_model.py"} <= files, files
    found = _run([str(bin_dir / "python"), "-c", "import importlib.util, os, sys, jdp.examples\n"
                  "print(os.path.dirname(jdp.examples.__file__))\n"
                  "for m in sys.argv[1:]: print(m, importlib.util.find_spec(m) is not None)", *sorted(modules)],
                 cwd=work, env=env).splitlines()
    folder = found[0]
    assert folder.startswith(str(bin_dir.parent)), folder
    assert [line for line in found[1:] if not line.endswith(" True")] == [], found
    assert [f for f in sorted(files) if not os.path.isfile(os.path.join(folder, f))] == []
    listing = _run([str(bin_dir / "python"), "-m", "jdp.examples"], cwd=work, env=env)
    assert listing.startswith(f"jdp's examples are in {folder}:") and f"bash {folder}/launch_local.sh" in listing
    out = _run([str(bin_dir / "python"), "-m", "jdp.examples.seed_demo"], cwd=work, env=env)
    assert "mean (lax.pmean)                                 2    -8.5000   1.0850" in out, out
