#!/usr/bin/env bash
# The GPU check: the CUDA and NCCL paths run for real, on a machine with one or more NVIDIA GPUs
# (about 5 minutes; every step is bounded, 8 minutes in all):
#   1. bench/overhead.py on the GPU, a snapshot after every step: step-time ratio (snapshots on / off),
#      the training thread's time inside the hooks (p50, p99), and the side stream's device-to-host GB/s;
#   2. a kill-and-swap with CUDA tensors (`deadpool demo --device cuda`, deterministic algorithms on)
#      and the bit-identity check against the same run without the kill. With two or more GPUs every
#      member has its own (spares too) and the group is NCCL, so its abort runs; with one GPU the
#      members share it, explicitly (`--gpus 0,0,0`), and the group is gloo (NCCL refuses two ranks on
#      one device).
# The last line printed is one JSON object.
#
#   bash bench/gpu_check.sh [--dry-run] [OUT_DIR]       (OUT_DIR defaults to ./gpu-check)
#
# On a fresh GPU machine it makes .venv on top of the machine's own CUDA torch (bench/gpu_venv.sh). A
# machine that cannot reach a package index installs from gpu-wheels/, made beforehand on a connected
# one with `bash bench/gpu_wheels.sh` (and carried along with the working tree).
#
# --dry-run: every step but the CUDA calls, on the CPU, with the same scripts, options and parsing at
# small sizes, and the offline install from gpu-wheels/ (when present) into a scratch venv: it checks
# this script on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:-gpu-check}
mkdir -p "$OUT"
START=$(date +%s)

if [ "$DRY" = 1 ]; then
  [ -x .venv/bin/python ] || { echo "--dry-run uses this checkout's .venv (make test makes it)" >&2; exit 2; }
  if [ -d gpu-wheels ]; then  # the offline install a GPU machine without an index would do
    SCRATCH=$(mktemp -d)
    GPU_VENV_SYSTEM_SITE=0 bash bench/gpu_venv.sh "$SCRATCH/venv"
    "$SCRATCH/venv/bin/python" -c 'import deadpool_cli.main, deadpool_protocol, nats, msgpack, xxhash, structlog'
    echo "offline install from gpu-wheels/: ok" | tee "$OUT/install.txt"
    rm -rf "$SCRATCH"
  else
    echo "offline install not checked: no gpu-wheels/ (bash bench/gpu_wheels.sh makes it)" | tee "$OUT/install.txt"
  fi
else
  bash bench/gpu_venv.sh .venv
fi
VPY=.venv/bin/python

if [ "$DRY" = 1 ]; then
  DEVICE=cpu; GPUS=0; NAME="dry run: CPU"; SIZE=tiny; PAIRS=1; STEPS=8; SWAP_STEPS=16; KILL_STEP=8
else
  DEVICE=cuda; SIZE=medium; PAIRS=2; STEPS=16; SWAP_STEPS=24; KILL_STEP=12
  GPUS=$($VPY -c 'import torch; print(torch.cuda.device_count())')
  [ "$GPUS" -ge 1 ] || { echo "no CUDA device visible to torch" >&2; exit 2; }
  NAME=$($VPY -c 'import torch; print(torch.cuda.get_device_name(0), "torch", torch.__version__, "cuda", torch.version.cuda)')
fi
if [ "$GPUS" -ge 2 ]; then  # a GPU per member: NPROC ranks + 1 spare
  export DEADPOOL_BACKEND=nccl; NPROC=$((GPUS > 4 ? 3 : GPUS - 1)); SWAP_GPUS=auto; BENCH_GPUS=auto
else  # one GPU (or the dry run): shared by every member, gloo
  export DEADPOOL_BACKEND=gloo; NPROC=2; SWAP_GPUS=0,0,0; BENCH_GPUS=0,0
fi
KILL_RANK=$((NPROC - 1))
echo "$NAME; $GPUS GPU(s); backend $DEADPOOL_BACKEND, $NPROC ranks + 1 spare" | tee "$OUT/device.txt"

if [ "$DRY" = 0 ]; then  # exactly sized pinned buffers (issue 25) beside torch's pin_memory, 1.65 GB each
  timeout 90 $VPY - <<'PINNED' 2>&1 | tee "$OUT/pinned.txt" || true
import json, time, torch
from deadpool.pinned_memory import pinned_bytes
n, out = 1_650_000_000, {}
src = torch.empty(n, dtype=torch.uint8, device="cuda")
for name, make in (("exact", lambda: pinned_bytes(n)), ("pin_memory", lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True))):
    t = time.perf_counter(); buf = make(); alloc_s = time.perf_counter() - t
    torch.cuda.synchronize(); t = time.perf_counter(); buf.copy_(src, non_blocking=True); torch.cuda.synchronize()
    out[name] = {"alloc_s": round(alloc_s, 3), "d2h_gb_per_s": round(n / (time.perf_counter() - t) / 1e9, 2)}
    del buf
print(json.dumps(out))
PINNED
fi

timeout 270 $VPY bench/overhead.py --device "$DEVICE" --gpus "$BENCH_GPUS" --pairs "$PAIRS" --steps "$STEPS" \
  --warm-up-steps 4 --model-size "$SIZE" 2>&1 | tee "$OUT/overhead.txt"
tail -n 1 "$OUT/overhead.txt" > "$OUT/overhead.json"
timeout 200 $VPY -m deadpool_cli demo --device "$DEVICE" --gpus "$SWAP_GPUS" --nproc "$NPROC" --spares 1 \
  --kill-rank "$KILL_RANK" --model-size "$SIZE" --steps "$SWAP_STEPS" --kill-step "$KILL_STEP" \
  --report "$OUT/demo.json" --run-dir "$OUT/demo-run" 2>&1 | tee "$OUT/demo.txt" || true

$VPY - "$OUT" "$DRY" "$GPUS" "$DEADPOOL_BACKEND" "$NAME" "$(($(date +%s) - START))" <<'EOF'
import json, sys
from pathlib import Path

out, dry, gpus, backend, name, took = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6])
overhead = json.loads((out / "overhead.json").read_text())
demo = json.loads((out / "demo.json").read_text()) if (out / "demo.json").exists() else {}
incidents = demo.get("incidents", [])
goals = {"step_time_ratio_max": 1.01, "stall_ms_p99_max": 1.0, "downtime_s_max": 1.0}
result = {
    "dry_run": dry,
    "device": name,
    "gpus": gpus,
    "backend": backend,
    "step_time_ratio": overhead["step_time_ratio"],
    "stall_ms_p50": overhead["stall_ms_p50"],
    "stall_ms_p99": overhead["stall_ms_p99"],
    "d2h_gb_per_s": overhead.get("d2h_gb_per_s"),
    "committed_fraction": overhead["committed_fraction"],
    "swap_recovered": bool(demo.get("recovered")),
    "swap_bit_identical": bool(demo.get("bit_identical")),
    "swap_downtime_s": incidents[0]["downtime_s"] if incidents else None,
    "seconds": took,
    "goals": goals,
}
result["goals_met"] = (
    result["step_time_ratio"] <= goals["step_time_ratio_max"]
    and result["stall_ms_p99"] <= goals["stall_ms_p99_max"]
    and result["swap_recovered"]
    and result["swap_bit_identical"]
    and result["swap_downtime_s"] is not None
    and result["swap_downtime_s"] <= goals["downtime_s_max"]
)
print(json.dumps(result))
sys.exit(0 if result["swap_recovered"] and result["swap_bit_identical"] else 1)
EOF
