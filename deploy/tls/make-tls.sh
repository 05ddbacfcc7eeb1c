#!/usr/bin/env bash
# Make a deployment's TLS files, laid out as DEADPOOL_TLS reads them (docs/operations.md §2):
#   deploy/tls/make-tls.sh DIR NAME...     each NAME a DNS name or IP address the servers are reached at
#   DIR/ca.pem          the authority every DeadPool host trusts (ca-key.pem signs: keep it off the hosts)
#   DIR/cert.pem        a certificate naming every NAME, and its key.pem: for NATS servers and stores
#   DIR/routes/         the same under a second authority: the NATS cluster's routes, on NATS hosts only
# One certificate for every server keeps a small deployment simple; a PKI of your own may issue one per
# host instead (the layout is all DeadPool reads).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: make-tls.sh DIR NAME..." >&2
  exit 2
fi
dir="$1"
shift
names=""
for name in "$@"; do
  if [[ "$name" =~ ^[0-9.]+$ || "$name" == *:* ]]; then names+="IP:$name,"; else names+="DNS:$name,"; fi
done
extensions="subjectAltName=${names%,}
extendedKeyUsage=serverAuth,clientAuth"

authority() ( # DIR WHAT: an authority and one certificate of it
  mkdir -p "$1"
  umask 077 # the keys: this subshell's only
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
    -keyout "$1/ca-key.pem" -out "$1/ca.pem" -subj "/CN=DeadPool $2 authority" 2>/dev/null
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$1/key.pem" -out "$1/request.pem" -subj "/CN=deadpool $2" 2>/dev/null
  openssl x509 -req -in "$1/request.pem" -CA "$1/ca.pem" -CAkey "$1/ca-key.pem" -days 825 \
    -set_serial "0x$(openssl rand -hex 16)" -extfile <(printf '%s\n' "$extensions") -out "$1/cert.pem" 2>/dev/null
  rm "$1/request.pem"
  chmod 0644 "$1/ca.pem" "$1/cert.pem"
)
authority "$dir" clients
authority "$dir/routes" routes
echo "TLS files in $dir (naming $*): set DEADPOOL_TLS=$dir on every DeadPool host; keep ca-key.pem offline"
