#!/usr/bin/env bash
# The deployment's credentials and TLS files, and one Secret per workload holding its own role's files
# only (docs/operations.md §2), written as DIR/secrets.yaml for `kubectl apply -f`:
#   deploy/kubernetes/make-secrets.sh [--store NAME]... [--job JOB]... [--tls-name ADDRESS]... DIR
#
#   Secret               its files                                                     mounted by
#   deadpool-nats        nats-auth.conf, ca.pem, cert.pem, key.pem, routes-*.pem       the NATS pods
#   deadpool-detector    detector.nk, ca.pem                                           detectors
#   deadpool-swapper     swapper.nk, dataplane.key, seal.key, ca.pem                   swappers
#   deadpool-store-NAME  store.nk (stores/NAME.nk), dataplane.key, ca.pem, cert.pem,   store NAME
#                        key.pem
#   deadpool-job-JOB     job.nk (jobs/JOB.nk), ca.pem                                  job JOB's pods
# admin.nk and the authorities' keys (ca-key.pem) go in no Secret: they stay in DIR, off the cluster.
#
# DIR/credentials is `deadpool credentials`'s (kept if there: a second run adds stores and jobs), DIR/tls
# is deploy/tls/make-tls.sh's, made once, naming the NATS pods' and Service's DNS names, localhost, and
# each --tls-name: every store's node address (its InternalIP, which the store advertises), since
# members verify a store against the address it announces. Every store and job made so far gets its
# Secret. DEADPOOL names the deadpool command (default: deadpool on PATH).
set -euo pipefail

NAMESPACE=deadpool # the manifests' namespace
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
deadpool=${DEADPOOL:-deadpool}

usage() {
  echo "usage: make-secrets.sh [--store NAME]... [--job JOB]... [--tls-name ADDRESS]... DIR" >&2
  exit 2
}

kube_name() { # a store's or job's name must also name Kubernetes objects (a DNS label)
  if ! [[ "$1" =~ ^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$ ]]; then
    echo "make-secrets.sh: '$1' is not a usable name here: 1 to 40 lowercase letters, digits or '-'" >&2
    exit 2
  fi
}

credential_args=()
tls_names=()
dir=""
while [ $# -gt 0 ]; do
  case "$1" in
    --store | --job)
      [ $# -ge 2 ] || usage
      kube_name "$2"
      credential_args+=("$1" "$2")
      shift 2
      ;;
    --tls-name)
      [ $# -ge 2 ] || usage
      tls_names+=("$2")
      shift 2
      ;;
    -*) usage ;;
    *)
      [ -z "$dir" ] || usage
      dir=$1
      shift
      ;;
  esac
done
[ -n "$dir" ] || usage

umask 077
mkdir -p "$dir"
"$deadpool" credentials "$dir/credentials" ${credential_args[@]+"${credential_args[@]}"} >/dev/null
stores=("$dir"/credentials/stores/*.nk)

if [ ! -f "$dir/tls/ca.pem" ]; then
  if [ -e "${stores[0]}" ] && [ ${#tls_names[@]} -eq 0 ]; then
    echo "make-secrets.sh: stores advertise their node's address, which their certificate must name:" >&2
    echo "  give --tls-name ADDRESS for each store's node (kubectl get nodes -o wide: INTERNAL-IP)" >&2
    exit 2
  fi
  nats_names=()
  for n in 0 1 2; do nats_names+=("nats-$n.nats-cluster.$NAMESPACE.svc"); done
  # localhost: an operator's `kubectl port-forward svc/nats 4222` (README.md)
  bash "$here/../tls/make-tls.sh" "$dir/tls" "${nats_names[@]}" "nats.$NAMESPACE.svc" localhost \
    ${tls_names[@]+"${tls_names[@]}"} >/dev/null
elif [ ${#tls_names[@]} -gt 0 ]; then
  echo "make-secrets.sh: $dir/tls exists and is kept: to name new addresses, move it away and run again" >&2
fi

out="$dir/secrets.yaml"
: >"$out"

secret() { # NAME KEY=FILE...: a Secret of those files, appended to secrets.yaml
  local name=$1
  shift
  {
    printf -- '---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: %s\n  namespace: %s\n' "$name" "$NAMESPACE"
    printf '  labels:\n    app.kubernetes.io/part-of: deadpool\ntype: Opaque\ndata:\n'
    local pair
    for pair in "$@"; do
      printf '  %s: %s\n' "${pair%%=*}" "$(base64 <"${pair#*=}" | tr -d '\n')"
    done
  } >>"$out"
}

c=$dir/credentials
t=$dir/tls
secret deadpool-nats "nats-auth.conf=$c/nats-auth.conf" "ca.pem=$t/ca.pem" "cert.pem=$t/cert.pem" "key.pem=$t/key.pem" \
  "routes-ca.pem=$t/routes/ca.pem" "routes-cert.pem=$t/routes/cert.pem" "routes-key.pem=$t/routes/key.pem"
secret deadpool-detector "detector.nk=$c/detector.nk" "ca.pem=$t/ca.pem"
secret deadpool-swapper "swapper.nk=$c/swapper.nk" "dataplane.key=$c/dataplane.key" "seal.key=$c/seal.key" "ca.pem=$t/ca.pem"
for key in "$c"/stores/*.nk; do
  [ -e "$key" ] || continue
  name=$(basename "$key" .nk)
  kube_name "$name"
  secret "deadpool-store-$name" "store.nk=$key" "dataplane.key=$c/dataplane.key" "ca.pem=$t/ca.pem" \
    "cert.pem=$t/cert.pem" "key.pem=$t/key.pem"
done
for key in "$c"/jobs/*.nk; do
  [ -e "$key" ] || continue
  name=$(basename "$key" .nk)
  kube_name "$name"
  secret "deadpool-job-$name" "job.nk=$key" "ca.pem=$t/ca.pem"
done

echo "Secrets in $out (private keys: keep it off version control). Next:"
echo "  kubectl apply -f $out"
echo "  (a job added to running NATS pods: once the pods see the new nats-auth.conf, about a minute,"
echo "   kubectl -n $NAMESPACE exec nats-N -- nats-server --signal reload=1   for N in 0 1 2)"
