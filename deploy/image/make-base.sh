#!/usr/bin/env bash
# The images' base without a registry: a minimal Debian (bookworm, whose python3 is 3.11) made from
# Debian's own packages by debootstrap and imported into the local engine.
#   deploy/image/make-base.sh [TAG]        (default deadpool-base:bookworm; needs root and debootstrap)
# DEADPOOL_DEBIAN_MIRROR picks the mirror (default: deb.debian.org). Kept if the tag already exists.
set -euo pipefail
tag="${1:-deadpool-base:bookworm}"
mirror="${DEADPOOL_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "$tag exists"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is needed (apt-get install debootstrap)" >&2; exit 2; }
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
# python3-venv brings ensurepip's pip wheel: the images install into a venv from wheels, never from PyPI.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,procps bookworm "$root" "$mirror"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import \
    --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$tag"
echo "$tag imported"
