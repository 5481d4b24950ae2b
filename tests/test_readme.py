"""Every Python block in README.md runs as written, each on its own, in a fresh process as a user would."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    BLOCKS = re.findall(r"```python\n(.*?)```", f.read(), re.S)

# One process for all blocks (importing jax costs ~1 s each), each block in its own namespace, so a
# block that uses a name it does not define fails. Fake devices are those the blocks ask for.
RUNNER = """
import sys
blocks = sys.stdin.read().split("\\0")
for i, code in enumerate(blocks):
    print(f"--- block {i}", flush=True)
    exec(compile(code, f"README block {i}", "exec"), {"__name__": "__main__"})
print("--- all blocks ran", flush=True)
"""


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 6


def test_every_python_block_runs_as_written(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"
    run = subprocess.run([sys.executable, "-W", "error", "-c", RUNNER], input="\0".join(BLOCKS), text=True,
                         capture_output=True, cwd=tmp_path, env=env, timeout=600)
    assert run.returncode == 0 and "--- all blocks ran" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]
