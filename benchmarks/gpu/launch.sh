#!/usr/bin/env bash
# On the lent GPU machine: install the carried wheels (.whl/, made here by
# `python -m benchmarks.gpu.wheels`) into a temporary prefix, never touching the
# image's torch, then run the GPU script with its arguments (every claim, under 8 min):
#
#     bash benchmarks/gpu/launch.sh --out "$OUT/gpu_full"
#
# PYTHON picks the interpreter (default python3); GPU_SCRIPT the module to run
# (default benchmarks.gpu_full; benchmarks.gpu_check is the older two-minute check).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
SITE=${BATCHSCOPE_GPU_SITE:-/tmp/batchscope-site}
shopt -s nullglob
wheels=(.whl/*.whl)
if ((${#wheels[@]})); then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${wheels[@]}"
else
    echo "no wheels in .whl/: run 'python -m benchmarks.gpu.wheels' where pip works" >&2
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.cuda.is_available())"
exec "$PY" -m "${GPU_SCRIPT:-benchmarks.gpu_full}" "$@"
