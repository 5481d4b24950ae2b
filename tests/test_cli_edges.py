"""The `jdp` command's edges: it starts without jax, Ctrl-C ends it in one line with exit code 130,
and a reader that closes the pipe ends it quietly."""
import os
import signal
import subprocess
import sys
import time

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
