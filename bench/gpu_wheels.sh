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
# The project's own dependencies, read from pyproject.toml (one list, so a new one is never missed here).
mapfile -t DEPS < <("$PY" -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"], sep="\n")')
# nkeys is published as source only: build its (pure-Python) wheel here, where the downloads find it.
"$PY" -m pip wheel --quiet --no-deps --wheel-dir gpu-wheels "nkeys>=0.2"
for version in 3.10 3.11 3.12 3.13; do
  "$PY" -m pip download --quiet --dest gpu-wheels --find-links gpu-wheels --only-binary=:all: --python-version "$version" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    "setuptools>=77" "${DEPS[@]}"
done
du -sh gpu-wheels
