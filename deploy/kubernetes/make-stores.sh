#!/usr/bin/env bash
# One snapshot store per node, as manifests on stdout (kubectl apply -f -):
#   deploy/kubernetes/make-stores.sh [--capacity-gib N] [--port PORT] STORE=NODE...
#   deploy/kubernetes/make-stores.sh --capacity-gib 64 store-a=gpu-node-1 store-b=gpu-node-2 > stores.yaml
#
# Why one DaemonSet per store rather than one for all: each store holds a key of its own
# (stores/STORE.nk, `deadpool credentials --store STORE`), which lets it announce its own name and
# report its own copies only. A single DaemonSet's pods share one template, so they would share one
# Secret: every node would hold every store's key, and any of them could speak for all the others
# (forged completions once committed a step the job never reached). So each store gets a DaemonSet
# pinned to its node (by the node's name), mounting its own Secret deadpool-store-STORE
# (make-secrets.sh --store STORE) and nothing else. The cost: adding a node is a run of this script
# and of make-secrets.sh, not a label.
#
# Each store listens on PORT in its pod and is reached on its node's address at the same hostPort: it
# advertises the node's IP (status.hostIP), which its certificate must name (make-secrets.sh
# --tls-name). Its --node is the node name's first label, the name the trainer's pods give their host
# (DEADPOOL_HOST in trainer-job.yaml), so a rank's snapshots are kept off its own node. Memory: the
# capacity plus 1 GiB, requested and limited alike (docs/operations.md §3: a store must never swap).
set -euo pipefail

NATS=nats://nats-0.nats-cluster.deadpool.svc:4222,nats://nats-1.nats-cluster.deadpool.svc:4222,nats://nats-2.nats-cluster.deadpool.svc:4222
capacity_gib=8
port=7001

usage() {
  echo "usage: make-stores.sh [--capacity-gib N] [--port PORT] STORE=NODE..." >&2
  exit 2
}

pairs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --capacity-gib)
      if [ $# -lt 2 ] || ! [[ "$2" =~ ^[1-9][0-9]*$ ]]; then usage; fi
      capacity_gib=$2
      shift 2
      ;;
    --port)
      if [ $# -lt 2 ] || ! [[ "$2" =~ ^[1-9][0-9]{0,4}$ ]] || [ "$2" -ge 65536 ]; then usage; fi
      port=$2
      shift 2
      ;;
    *=*)
      pairs+=("$1")
      shift
      ;;
    *) usage ;;
  esac
done
[ ${#pairs[@]} -gt 0 ] || usage

seen_stores=" "
seen_nodes=" "
for pair in "${pairs[@]}"; do
  store=${pair%%=*}
  node=${pair#*=}
  if ! [[ "$store" =~ ^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$ ]]; then
    echo "make-stores.sh: store '$store': 1 to 40 lowercase letters, digits or '-' (it names Kubernetes objects)" >&2
    exit 2
  fi
  if ! [[ "$node" =~ ^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$ ]]; then
    echo "make-stores.sh: '$node' is not a node name (kubectl get nodes)" >&2
    exit 2
  fi
  if [[ "$seen_stores" == *" $store "* || "$seen_nodes" == *" $node "* ]]; then
    echo "make-stores.sh: store '$store' or node '$node' given twice (one store per node: they share the port)" >&2
    exit 2
  fi
  seen_stores+="$store "
  seen_nodes+="$node "
done

# Only once every pair is known good: a refusal prints nothing to apply.
for pair in "${pairs[@]}"; do
  store=${pair%%=*}
  node=${pair#*=}
  host=${node%%.*} # the node's name as DeadPool names hosts: its first label
  cat <<EOF
---
# Snapshot store $store, on node $node only, with its own key (Secret deadpool-store-$store).
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: deadpool-store-$store
  namespace: deadpool
  labels:
    app.kubernetes.io/name: deadpool-store
    app.kubernetes.io/part-of: deadpool
    deadpool.io/store: $store
spec:
  selector:
    matchLabels:
      app.kubernetes.io/name: deadpool-store
      deadpool.io/store: $store
  updateStrategy:
    type: RollingUpdate
    rollingUpdate:
      maxUnavailable: 1
  template:
    metadata:
      labels:
        app.kubernetes.io/name: deadpool-store
        app.kubernetes.io/part-of: deadpool
        deadpool.io/store: $store
    spec:
      automountServiceAccountToken: false
      enableServiceLinks: false
      securityContext:
        runAsNonRoot: true
        runAsUser: 10001
        runAsGroup: 10001
        fsGroup: 10001
        seccompProfile:
          type: RuntimeDefault
      affinity:
        nodeAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            nodeSelectorTerms:
              - matchFields:
                  - key: metadata.name
                    operator: In
                    values: ["$node"]
      containers:
        - name: store
          image: deadpool-hotswap:0.1.0
          imagePullPolicy: IfNotPresent
          args:
            - store
            - --nats
            - $NATS
            - --credentials
            - /run/secrets
            - --id
            - $store
            - --host
            - 0.0.0.0
            - --port
            - "$port"
            - --advertise-host
            - \$(HOST_IP)
            - --node
            - $host
            - --capacity-bytes
            - "$((capacity_gib * 1024 * 1024 * 1024))"
            - --nice
            - "10"
          env:
            - name: DEADPOOL_TLS
              value: /run/secrets
            - name: HOST_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.hostIP
          ports:
            - name: dataplane
              containerPort: $port
              hostPort: $port
              protocol: TCP
          livenessProbe:
            exec:
              command:
                - deadpool
                - ping
                - --nats
                - $NATS
                - --credentials
                - /run/secrets
                - --role
                - store
                - deadpool-store
            initialDelaySeconds: 10
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 3
          resources:
            requests:
              cpu: "1"
              memory: $((capacity_gib + 1))Gi
            limits:
              memory: $((capacity_gib + 1))Gi
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities:
              drop: ["ALL"]
          volumeMounts:
            - name: secrets
              mountPath: /run/secrets
              readOnly: true
            - name: tmp
              mountPath: /tmp
      volumes:
        - name: secrets
          secret:
            secretName: deadpool-store-$store
            defaultMode: 0440
            items:
              - key: store.nk
                path: store.nk
              - key: dataplane.key
                path: dataplane.key
              - key: ca.pem
                path: ca.pem
              - key: cert.pem
                path: cert.pem
              - key: key.pem
                path: key.pem
        - name: tmp
          emptyDir:
            sizeLimit: 64Mi
EOF
done
