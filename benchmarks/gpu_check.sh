#!/usr/bin/env bash
# jdp on one GPU (an H200) in at most 8 minutes, written to ONE markdown report: the tests that need
# one device, GPT-2 small float32 vs bfloat16 (tokens/s, step time, MFU), the largest global batch
# with remat on and off, and how exact bf16 computation and communication are (benchmarks/gpu_check.py
# says what each part does and how long it may take).
#
#   benchmarks/gpu_check.sh              # on the GPU machine; report: $OUT/gpu_check.md, else
#                                        # benchmarks/results/gpu_check.md
#   benchmarks/gpu_check.sh --dry-run    # the same script on a CPU, tiny sizes (under a minute when idle)
#   benchmarks/gpu_check.sh --out FILE   # the report elsewhere
#
# Python: $JDP_PYTHON, else .venv/bin/python where it exists, else python3 (a GPU machine's own,
# with a CUDA jax). Packages that python lacks (jdp's data module imports grain) may be put in
# .whl/ as wheels: they are installed into a scratch folder first, nothing else is touched.
set -u
cd "$(dirname "$0")/.."
PY=${JDP_PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  SITE=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
    && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The check keeps to its own 450 s deadline and rewrites the report after every part; this outer
# limit only guarantees the 8 minutes if something hangs outside a part. A dry run's limits only
# guard against a hang (benchmarks/gpu_parts.py's DRY): its outer one is 30 minutes.
LIMIT=475
for arg in "$@"; do [ "$arg" = "--dry-run" ] && LIMIT=1900; done
[ "${JDP_GPU_CHECK_DRY_RUN:-}" = "1" ] && LIMIT=1900
exec timeout -k 5 "$LIMIT" "$PY" -m benchmarks.gpu_check "$@"
