#!/usr/bin/env bash
# The venv the GPU benchmarks run in, on top of the GPU machine's own CUDA torch (bench/gpu_check.sh,
# bench/scale.py --device cuda). From gpu-wheels/ when present (a machine that cannot reach a package
# index: `bash bench/gpu_wheels.sh` makes it on a connected one), else from the index. Does nothing when
# VENV already has a python.
#
#   bash bench/gpu_venv.sh [VENV]         (VENV defaults to .venv)
#   GPU_VENV_SYSTEM_SITE=0 bash bench/gpu_venv.sh DIR   a venv without the machine's packages (a check)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] && exit 0
if [ "${GPU_VENV_SYSTEM_SITE:-1}" = 1 ]; then
  "$PY" -m venv --system-site-packages "$VENV"
  # A python that is itself a venv's (as on many GPU images) passes on its base's site-packages, not its
  # own, where its torch is: a .pth file adds its own, after the new venv's.
  if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null && "$PY" -c 'import torch' 2>/dev/null; then
    "$PY" -c 'import site; print(*site.getsitepackages(), sep="\n")' \
      > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/gpu-host-site.pth"
  fi
else
  "$PY" -m venv "$VENV"
fi
if [ -d gpu-wheels ]; then
  "$VENV/bin/python" -m pip install --quiet --no-index --find-links gpu-wheels "setuptools>=77"
  "$VENV/bin/python" -m pip install --quiet --no-index --find-links gpu-wheels --no-build-isolation -e .
else
  "$VENV/bin/python" -m pip install --quiet -e .
fi
