#!/usr/bin/env bash
# make run-kube-apiserver: etcd, the local KMS v2 plugin and bin/kube-apiserver (kube-apiserver
# v1.37.2 with rekey inside) with the smallest set of flags it starts with, a sample
# encryption config (Secrets: KMS v2, ConfigMaps: aesgcm, automatic reload on) and a
# kubeconfig. It serves on loopback only, so the kubernetes Service gets no endpoints
# (--endpoint-reconciler-type none: loopback addresses cannot be advertised). Ctrl-C stops
# all three. State lives in $RUN_DIR (default /tmp/rekey-kube-apiserver); delete it to
# start over with fresh keys and data.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=hack/lib.sh
source hack/lib.sh

RUN_DIR=${RUN_DIR:-/tmp/rekey-kube-apiserver}
PORT=${PORT:-6443}
ETCD_PORT=${ETCD_PORT:-23790}
BIN=${BIN:-bin}

[ -x "$BIN/kube-apiserver" ] || { echo "!! $BIN/kube-apiserver missing: run make kube-apiserver"; exit 1; }
echo ">> building $BIN/etcd and $BIN/kms-plugin"
go build -o "$BIN/" ./hack/tools/etcd ./cmd/kms-plugin

prepare_run_dir
SA_KEY="$RUN_DIR/sa.key"
# The service-account token signing key (kube-apiserver refuses to start without one).
[ -f "$SA_KEY" ] || openssl ecparam -name prime256v1 -genkey -noout -out "$SA_KEY" 2>/dev/null
chmod 600 "$SA_KEY"

ETCD_URL="http://127.0.0.1:$ETCD_PORT"
PEER_URL="http://127.0.0.1:$((ETCD_PORT + 1))"
"$BIN/etcd" --name rekey --data-dir "$RUN_DIR/etcd" \
  --listen-client-urls "$ETCD_URL" --advertise-client-urls "$ETCD_URL" \
  --listen-peer-urls "$PEER_URL" --initial-advertise-peer-urls "$PEER_URL" \
  --initial-cluster "rekey=$PEER_URL" --log-level warn > "$RUN_DIR/etcd.log" 2>&1 &
PIDS+=($!)
start_plugin

START=$(date +%s%N)
"$BIN/kube-apiserver" \
  --etcd-servers "$ETCD_URL" \
  --secure-port "$PORT" --bind-address 127.0.0.1 --advertise-address 127.0.0.1 \
  --cert-dir "$RUN_DIR/certs" \
  --token-auth-file "$TOKENS" \
  --authorization-mode Node,RBAC \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$SA_KEY" --service-account-signing-key-file "$SA_KEY" \
  --service-cluster-ip-range 10.96.0.0/16 \
  --endpoint-reconciler-type none \
  --encryption-provider-config "$CONFIG" \
  --encryption-provider-config-automatic-reload=true \
  --storage-migration > "$RUN_DIR/kube-apiserver.log" 2>&1 &
APISERVER_PID=$!
PIDS+=($APISERVER_PID)

wait_ready kube-apiserver "$APISERVER_PID" "$RUN_DIR/kube-apiserver.log" 1200 -H "Authorization: Bearer $TOKEN"
write_kubeconfig rekey-kube-apiserver

cat <<MSG

$("$BIN/kube-apiserver" --version) is ready on https://127.0.0.1:$PORT
(ready ${READY_MS} ms after start; no controller-manager or scheduler: objects are stored, not acted on)
  etcd: $ETCD_URL (data in $RUN_DIR/etcd)     logs: $RUN_DIR/{kube-apiserver,etcd,kms-plugin}.log
  Secrets are encrypted with KMS v2 (plugin at $SOCK), ConfigMaps with aesgcm.

Use it:
  export KUBECONFIG=$KUBECONFIG_FILE
  kubectl create secret generic demo --from-literal=password=hunter2
  kubectl create configmap settings --from-literal=mode=demo
  kubectl get secrets,cm
  curl -s --cacert $CA -H "Authorization: Bearer $TOKEN" https://127.0.0.1:$PORT/rekey/status
  curl -s --cacert $CA -H "Authorization: Bearer $TOKEN" "https://127.0.0.1:$PORT/readyz?verbose"

Encrypt a custom resource: add a rule such as
- resources: ["*.example.com"]
  providers:
  - aesgcm: {keys: [{name: crd1, secret: $(rand32)}]}
  - identity: {}
to $CONFIG (before any "*.*" rule); it applies without a restart.

Rotate the plugin key: put a new key first in $KEYS, e.g.
  sed -i "1a - name: kek-2\\n  secret: \$(head -c 32 /dev/urandom | base64)" $KEYS
  New Secrets are written under kek-2 within a minute; --storage-migration re-encrypts the old ones.

Ctrl-C stops kube-apiserver, the plugin and etcd.
MSG

wait "$APISERVER_PID"
