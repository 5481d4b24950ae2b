#!/usr/bin/env bash
# jdp on one GPU (an H200) in at most 8 minutes, written to ONE markdown report that can be pasted
# into docs/performance.md: the tests that need one device, GPT-2 small float32 vs bfloat16, the
# largest batch found from the compiled step's memory and one timed run at it, bf16 exactness, the
# layouts compiled for 8 fake CPU devices, decoding speed and the side-by-side peer comparison
# (benchmarks/gpu_check.py says what each part does and how long it may take).
#
#   benchmarks/gpu_check.sh              # on the GPU machine; report: $OUT/gpu_check.md, else
#                                        # benchmarks/results/gpu_check.md
#   benchmarks/gpu_check.sh --dry-run    # every part on this CPU, tiny sizes (minutes on a loaded CPU)
#   benchmarks/gpu_check.sh --out FILE   # the report elsewhere
#
# Python: $JDP_PYTHON, else .venv/bin/python where it exists, else python3 (a GPU machine's own,
# with a CUDA jax). First the install step (benchmarks/gpu_check_install.py): jdp's requirements
# that this python lacks (the GPU image had no grain) are pip-installed with the jax, CUDA and torch
# packages already there pinned as they are; from wheels in .whl/ where that folder exists (a
# machine with no network), else from the index. A dry run only says what is missing.
set -u
cd "$(dirname "$0")/.."
PY=${JDP_PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DRY=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && DRY=1; done
[ "${JDP_GPU_CHECK_DRY_RUN:-}" = "1" ] && DRY=1
if [ "$DRY" = 1 ]; then CHECK_ONLY=--check; else CHECK_ONLY=; fi
JDP_GPU_CHECK_INSTALL=$(timeout 300 "$PY" -m benchmarks.gpu_check_install $CHECK_ONLY 2>&1 | tail -n 1)
export JDP_GPU_CHECK_INSTALL="${JDP_GPU_CHECK_INSTALL:-the install step printed nothing}"
echo "gpu_check: install: $JDP_GPU_CHECK_INSTALL" >&2
# The check keeps to its own 450 s deadline and rewrites the report after every part; this outer
# limit only guarantees the 8 minutes if something hangs outside a part. A dry run's limits only
# guard against a hang (benchmarks/gpu_parts.py's DRY): its outer one is 30 minutes.
LIMIT=475
[ "$DRY" = 1 ] && LIMIT=1900
exec timeout -k 5 "$LIMIT" "$PY" -m benchmarks.gpu_check "$@"
