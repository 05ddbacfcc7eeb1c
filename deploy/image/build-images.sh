#!/usr/bin/env bash
# Build deploy/compose.yaml's two images without any registry:
#   deadpool-hotswap:0.1.0  the services and nats-server (deploy/Dockerfile)
#   deadpool-trainer:0.1.0  the example trainer, with torch (deploy/Dockerfile.trainer)
# The base is deploy/image/make-base.sh's Debian (or BASE=python:3.11-slim where a registry is
# reachable); the project and every dependency are wheels built here on the host, by pip, into
# build/image/wheels, which is the images' build context. TORCH_SPEC picks the trainer's torch (default
# torch==2.13.0: pip takes a CPU wheel where the host's pip configuration offers one, as the Makefile
# does). Run from anywhere: deploy/image/build-images.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
base="${BASE:-deadpool-base:bookworm}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
python="${PYTHON:-python3}"
context="$root/build/image"

[ "$base" != "deadpool-base:bookworm" ] || "$root/deploy/image/make-base.sh" "$base"
# The wheels must suit the images' Python: the host's is asked to be the same minor version.
image_python="$(docker run --rm "$base" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
host_python="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [ "$image_python" != "$host_python" ]; then
    echo "the image's Python is $image_python and $python is $host_python: set PYTHON to a python$image_python" >&2
    exit 2
fi
mkdir -p "$context/wheels"
rm -f "$context"/wheels/deadpool_hotswap-*.whl  # the project's own wheel is rebuilt every time
"$python" -m pip wheel --quiet --wheel-dir "$context/wheels" --find-links "$context/wheels" \
    "${root}[trainer]" "$torch_spec"
rm -rf "$context/examples" && cp -r "$root/examples" "$context/examples"
find "$context/examples" -name __pycache__ -prune -exec rm -rf {} +
docker build --quiet --build-arg "BASE=$base" -f "$root/deploy/Dockerfile" -t deadpool-hotswap:0.1.0 "$context"
docker build --quiet --build-arg "BASE=$base" -f "$root/deploy/Dockerfile.trainer" -t deadpool-trainer:0.1.0 "$context"
echo "built deadpool-hotswap:0.1.0 and deadpool-trainer:0.1.0 on $base"
