"""The `jdp` command's edges: it starts without jax, Ctrl-C ends it in one line with exit code 130
from the first line of jdp's code it runs, and a reader that closes the pipe ends it quietly."""
import os
import signal
import subprocess
import sys
import time
import tomllib

import jdp
from benchmarks.common import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_env()
JDP = [sys.executable, "-m", "jdp.run.cli"]
INTERRUPTED = "jdp: interrupted (Ctrl-C); a run's checkpoints already saved are intact.\n"


def test_the_command_and_import_jdp_do_not_import_jax():
    """`jdp --version` and `jdp --help` answer at once because nothing on their path imports jax
    (`benchmarks/cli_startup.py` times them)."""
    code = ("import sys, jdp, jdp.run.cli; jdp.run.cli.build_parser().format_help(); "
            "print(sorted(m for m in ('jax', 'flax', 'optax', 'orbax', 'grain') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=ROOT, check=True)
    assert out.stdout == "[]\n", out.stderr


def test_a_closed_pipe_ends_quietly(tmp_path):
    """`jdp config schema | head -1`: the reader is gone before jdp writes, no traceback, exit 141."""
    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run([*JDP, "config", "schema"], stdout=write, stderr=subprocess.PIPE, text=True, env=ENV,
                             cwd=tmp_path, timeout=120)
    finally:
        os.close(write)
    assert (out.returncode, out.stderr) == (141, "")


def test_ctrl_c_at_start_up_prints_one_line_and_exits_130(tmp_path):
    """SIGINT while `jdp train` is still starting (importing jax, building the task, compiling):
    one line, exit code 130. A KeyboardInterrupt there is often raised inside jax's garbage-collection
    callback, which Python ignores ("Exception ignored"), and the run went on training."""
    proc = subprocess.Popen([*JDP, "train", "--workdir", str(tmp_path / "w"), "--steps", "2000", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path)
    time.sleep(1.0)  # past Python's own start-up (~0.1 s), well before the first step (5+ s here)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert (proc.returncode, err, out) == (130, INTERRUPTED, ""), err[-1500:]


# Run first in a `jdp` script: SIGINT to itself as the named module starts importing (or, for
# "atexit", while the interpreter shuts down after main() returned), at the same point every run.
SIGINT_AT = """import atexit, os, signal, sys
class SigintAt:
    def find_spec(self, name, path=None, target=None):
        if name == {0!r}:
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, SigintAt())
if {0!r} == "atexit":
    atexit.register(os.kill, os.getpid(), signal.SIGINT)
"""


# Run first in a `jdp` script: as the command line starts importing (the handler is installed by
# then), a garbage collection whose callback sends SIGINT and goes on running Python code, as jax's
# gc callback does after a long call into XLA.
SIGINT_IN_GC = """import gc, os, signal, sys
def sigint_in_gc(phase, info):
    if phase == "start":
        gc.callbacks.remove(sigint_in_gc)
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))
class CollectAt:
    def find_spec(self, name, path=None, target=None):
        if name == "jdp.run.cli":
            gc.callbacks.append(sigint_in_gc)
            gc.collect()
        return None
sys.meta_path.insert(0, CollectAt())
"""


def _jdp_script(folder, sigint_at: str, first: str = SIGINT_AT) -> str:
    """The script pip writes for pyproject's `jdp` entry point, in `folder`, with `first` (SIGINT_AT
    for the module `sigint_at`) run first."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        module, function = tomllib.load(f)["project"]["scripts"]["jdp"].split(":")
    path = os.path.join(folder, "jdp")
    with open(path, "w") as f:
        f.write(first.format(sigint_at) + f"import re\nimport sys\nfrom {module} import {function}\n"
                "if __name__ == '__main__':\n"
                "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                f"    sys.exit({function}())\n")
    return path


def test_ctrl_c_from_jdps_first_line_prints_one_line_and_exits_130(tmp_path):
    """The `jdp` script's entry point installs the SIGINT handler before it imports the command
    line: a Ctrl-C while argparse, subprocess (the supervisor) or the command's modules are
    imported, or once main() has returned, ends in one line and 130, where it printed Python's
    KeyboardInterrupt traceback, or was "ignored" inside the import system while the run trained
    on. Before jdp's first line (here: while `jdp` itself is found) Python's own traceback is
    still what a Ctrl-C prints: the limit the docs state."""
    work = str(tmp_path / "w")
    cases = [("jdp.run.cli", ["--version"], ""), ("argparse", ["train", "--help"], ""),
             ("subprocess", ["--version"], ""), ("jax", ["train", "--workdir", work, "--steps", "5"], ""),
             ("atexit", ["--version"], f"jdp {jdp.__version__}\n")]
    for at, args, stdout in cases:
        out = subprocess.run([sys.executable, _jdp_script(tmp_path, at), *args], capture_output=True, text=True,
                             env=ENV, cwd=tmp_path, timeout=120)
        assert (out.returncode, out.stderr, out.stdout) == (130, INTERRUPTED, stdout), (at, out.stderr[-1500:])
    assert not os.path.exists(work)
    out = subprocess.run([sys.executable, _jdp_script(tmp_path, "jdp"), "--version"], capture_output=True, text=True,
                         env=ENV, cwd=tmp_path, timeout=120)
    assert out.returncode == -signal.SIGINT and out.stderr.endswith("\nKeyboardInterrupt\n"), out.stderr[-1500:]


def test_ctrl_c_in_a_gc_callback_prints_one_line_and_exits_130(tmp_path):
    """A KeyboardInterrupt raised inside a garbage-collection callback is printed by Python as
    "Exception ignored" and the command carries on (a `jdp train` then trains on): jdp's handler
    ends the process from inside the callback instead, with one line and 130."""
    script = _jdp_script(tmp_path, "", SIGINT_IN_GC.replace("{", "{{").replace("}", "}}"))
    out = subprocess.run([sys.executable, script, "--version"], capture_output=True, text=True, env=ENV, cwd=tmp_path,
                         timeout=120)
    assert (out.returncode, out.stderr, out.stdout) == (130, INTERRUPTED, ""), out.stderr[-1500:]


def test_import_jdp_leaves_ctrl_c_to_python():
    """Code that imports jdp (the entry point's module included) keeps Python's KeyboardInterrupt:
    only the `jdp` command's main() installs its handler."""
    code = ("import signal, jdp, jdp.run.entry, jdp.run.cli; "
            "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=ROOT, check=True)
    assert out.stdout == "True\n", out.stderr


def test_a_profile_range_the_run_cannot_reach_is_refused_before_training(tmp_path):
    """`jdp train --steps 4 --profile-steps 10:20` ran 4 steps and exited 0 with no trace and no word."""
    for profile, where, example in (("10:20", "starts at step 10", "4:4"), ("3:6", "ends at step 6", "3:4")):
        done = subprocess.run([*JDP, "train", "--steps", "4", "--profile-steps", profile, "--workdir", "w"],
                              capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=120)
        assert (done.returncode, done.stdout) == (2, ""), done.stderr[-2000:]
        assert done.stderr == (f"jdp: error: train.profile_steps='{profile}' (--profile-steps) {where}, after the "
                               f"run's last step, train.steps=4, so no trace would be written; profile steps within "
                               f"1..4, e.g. {example}.\n")
    assert os.listdir(tmp_path) == []  # nothing written, not even the workdir
