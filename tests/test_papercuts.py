"""What a newcomer meets in the first hour: `jdp --version`, a script beside a clone named jdp/,
`jdp plot` without matplotlib, the plot's labels, `jdp explain` in 80 columns, the console's
global-batch line."""
import ast
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
import jdp
import jdp.run.cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        jdp.run.cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"jdp {jdp.__version__}\n"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]  # one source: jdp.__version__
    from importlib.metadata import version

    from jdp.extras import DISTRIBUTION

    assert version(DISTRIBUTION) == jdp.__version__  # what the installed metadata says (jdp-train)


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


def _explain_results(ns):
    """A full `jdp explain` result of the real shape (no step compiled): every table at full size."""
    from jdp.inspect import explain as ex

    def seed(w0, grads, n):
        return {"w0": w0, "lr": 0.1, "devices": n, "one_device": {"grad": grads[0], "w": w0},
                "local_grads": grads[:n], "mean": {"grad": grads[0], "w": w0}, "sum": {"grad": grads[1], "w": w0},
                "sum_lr_over_n": {"lr": 0.1 / n, "w": w0}}

    matrix = [{"optimizer": o, "clip": c, "clip_norm": 1.026 if c else None, "reduction": r, "devices": n,
               "max_abs_dparam": 0.3220 if r == "sum raw" else 6.0e-8}
              for o in ("sgd", "momentum", "adam", "adamw") for c in (False, True) for r in ex.REDUCTIONS for n in ns]
    bf16 = [{"optimizer": o, "reduce_dtype": d, "devices": n, "max_abs_dparam": 2.3e-4 if d == "bfloat16" else 3.7e-8,
             "relative": 7.6e-3 if d == "bfloat16" else 1.9e-6}
            for o in ("sgd", "adam") for d in ("float32", "bfloat16") for n in ((1, *ns) if d == "bfloat16" else ns)]
    return {"seed_single_param": seed(1.0, [-8.5, -17.0, -8.0, -9.0], 2),
            "seed_two_params": seed([0.5, -0.3], [[-4.15, -3.85], [-16.6, -15.4], [-3.7, -3.5], [-1.7, -1.5]], 4),
            "matrix": matrix,
            "bf16_comm": {"steps": 3, "rows": bf16, "movement": {"sgd": 0.032, "adam": 0.030},
                          "bf16_unit_roundoff": 2.0 ** -8,
                          "program_allreduce_bytes": {"devices": max(ns), "float32": 852, "bfloat16": 428}},
            "adam_eps": [{"loss_scale": s, "rms_grad": 4.7e-2 * s, "relative_deviation": 5.45e-05 / s ** 0.1}
                         for s in (1.0, 1e-3, 1e-5, 1e-6, 1e-7, 1e-8, 1e-9, 1e-10)],
            "clipping": [{"reduction": r, "clip_norm": 8.208 if r == "sum + exact" else 1.026, "steps": 20,
                          "clipped_steps": 20, "median_grad_norm_seen": 4.664} for r in ex.REDUCTIONS],
            "fp16": {"devices": 8, "per_device_grads": [9000.0 + 100 * i for i in range(8)], "fp16_max": 65504.0,
                     "true_mean": 9350.0, "psum": float("inf"), "lax_pmean": float("inf"),
                     "jdp_mean_divide_first": 9352.0},
            "conclusion": ex.CONCLUSION, "backend": "shard_map", "seconds": 49.0}


@pytest.mark.parametrize("ns", [(2, 4, 8), (2, 4, 8, 16, 32)])
def test_explain_tables_fit_80_columns_when_piped(ns, monkeypatch, capsys):
    """Piped, rich's console is 80 columns wide: no table may cut a cell to "all-re…"."""
    from jdp.inspect import explain as ex

    monkeypatch.delenv("COLUMNS", raising=False)
    ex.render(_explain_results(ns))  # rich's default console: stdout here is a capture, not a terminal
    text = capsys.readouterr().out
    assert "…" not in text and max(map(len, text.splitlines())) <= 80, text
    for word in ("all-reduce", "bfloat16", "optimizer", "reduction", "threshold compared", "clipped steps",
                 f"N={max(ns)}", "worst / moved", "lax.pmean (sum, then divide)"):
        assert word in text, word


def test_the_first_console_line_names_the_factors_of_the_global_batch(tmp_path):
    from jdp.config import load_config
    from jdp.train import train

    lines = []
    config = load_config(ROOT / "configs" / "seed_linear.yaml", ["parallel.devices=2", "parallel.accum_steps=2"])
    train(config, str(tmp_path / "run"), devices=jax.devices()[:2], log=lines.append, progress=False)
    assert ("global batch 8 = 2 accumulation steps × 2 devices × 2 examples per device, shard_map, reduction mean"
            in lines[0]), lines[0]


def _metrics(folder, records):
    folder.mkdir(exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(folder)


def test_plot_without_matplotlib_names_the_install_command_of_this_checkout(tmp_path, monkeypatch, capsys):
    """After the Quick start's `pip install -e .`: exit code 2, one sentence, a command that works here
    (`pip install 'jdp[plot]'` asks the index for jdp instead of installing this checkout's extra)."""
    work = _metrics(tmp_path / "run", [{"step": 1, "loss": 2.0}])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("matplotlib") for d in extras["plot"])
    for cwd, where in ((ROOT, "."), (tmp_path, str(ROOT))):
        monkeypatch.chdir(cwd)
        assert jdp.run.cli.main(["plot", work]) == 2
        assert capsys.readouterr().err == ("jdp: error: jdp plot needs matplotlib, which is not installed here; "
                                           f"install it with pip install -e '{where}[plot]'\n")
    assert not (tmp_path / "run" / "curves.png").exists()


def test_an_installed_wheel_names_the_distribution_on_the_index(tmp_path, monkeypatch, capsys):
    """Installed from a wheel (no pyproject.toml beside the package): the hint names `jdp-train`, the
    distribution's own name (the index's `jdp` is another project), which pyproject.toml declares."""
    import jdp.extras

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"] == jdp.extras.DISTRIBUTION
    work = _metrics(tmp_path / "run", [{"step": 1, "loss": 2.0}])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(jdp.extras, "checkout", lambda: None)
    assert jdp.run.cli.main(["plot", work]) == 2
    assert capsys.readouterr().err == ("jdp: error: jdp plot needs matplotlib, which is not installed here; "
                                       "install it with pip install 'jdp-train[plot]'\n")


def test_plot_has_axis_labels_the_run_name_and_marked_eval_points(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    import jdp.run.metrics

    records = [{"step": s, "loss": 2.0 / s, "train_accuracy": 0.1 * s} for s in (1, 2, 3, 4)]
    records += [{"step": s, "eval_loss": 2.5 / s, "eval_accuracy": 0.09 * s} for s in (2, 4)]
    work = _metrics(tmp_path / "digits_mlp", records)
    figures = []
    real = jdp.run.metrics.curves_figure
    monkeypatch.setattr(jdp.run.metrics, "curves_figure", lambda *a, **k: figures.append(real(*a, **k)) or figures[-1])
    assert jdp.run.cli.main(["plot", work]) == 0
    fig = figures[0]
    try:
        assert "digits_mlp" in fig.get_suptitle()  # the run's name: its directory
        assert all(ax.get_ylabel() and ax.get_xlabel() == "optimizer step" for ax in fig.axes)
        lines = {line.get_gid(): line for ax in fig.axes for line in ax.lines}
        assert set(lines) == {"loss", "train_accuracy", "eval_loss", "eval_accuracy"}
        for key, line in lines.items():
            assert (line.get_marker() == "o") == key.startswith("eval"), key  # eval points are few: each marked
            assert line.get_label() and not line.get_label().startswith("_"), key  # in the legend
    finally:
        plt.close(fig)


def _jdp_imports() -> dict[str, set[str]]:
    """{module: the jdp modules it imports, anywhere in its body (function-level imports count)}."""
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "jdp").rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x, from ..core import y
                    parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names)
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> set[str]:
    """Every import circle of `graph`, once each, as "a -> b -> a" from its smallest module."""
    circles = set()
    for start in graph:  # depth-first from each module: a path back to it is a circle
        stack = [(start, (start,))]
        while stack:
            module, path = stack.pop()
            for nxt in graph[module]:
                if nxt == start:
                    circles.add(" -> ".join((*path, start)))
                elif nxt not in path and nxt > start:
                    stack.append((nxt, (*path, nxt)))
    return circles


def test_no_import_circle_in_jdp():
    """Modules import in one direction only (jdp.inspect.explain and jdp.inspect.explain_precision imported each other)."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {"a -> b -> c -> a"}
    graph = _jdp_imports()
    assert sum(map(len, graph.values())) > 50  # the scan sees the imports
    assert not _circles(graph), sorted(_circles(graph))


def test_the_suites_compile_flags_are_probed_before_they_are_set(tmp_path, monkeypatch):
    """XLA aborts a process on a flag it does not know: conftest asks a subprocess first, once per
    jaxlib version, and sets the fast-compile flags only where they were accepted."""
    import conftest

    monkeypatch.setattr(conftest, "ROOT", str(tmp_path))  # a fresh record: each flag is really probed
    assert not conftest._xla_accepts("--xla_no_such_flag_for_jdp=1")
    accepted = conftest._xla_accepts(conftest.FAST_COMPILE)
    record = json.loads((tmp_path / ".pytest_cache" / "jdp-xla-flags.json").read_text())
    assert sorted(record.values()) == sorted([False, accepted]) and len(record) == 2
    if os.environ.get("JDP_TEST_FAST_COMPILE", "1") != "0":
        assert (conftest.FAST_COMPILE in os.environ["XLA_FLAGS"]) == accepted


def test_the_install_hint_names_the_wheel_where_no_pyproject_lies_beside_the_package(tmp_path, monkeypatch):
    """jdp.extras decides checkout or wheel by the pyproject.toml beside the package: a wheel's site-packages
    has none (the cheap form of tests/test_wheel.py, which installs one)."""
    import jdp.extras

    site = tmp_path / "site-packages"
    (site / "jdp").mkdir(parents=True)
    monkeypatch.setattr(jdp.extras, "__file__", str(site / "jdp" / "extras.py"))
    monkeypatch.chdir(tmp_path)
    assert jdp.extras.checkout() is None
    assert jdp.extras.install_command("plot") == "pip install 'jdp-train[plot]'"
    (site / "pyproject.toml").write_text("[project]\nname = 'jdp-train'\n")
    assert jdp.extras.checkout() == str(site)
    assert jdp.extras.install_command("plot") == f"pip install -e '{site}[plot]'"
