#!/usr/bin/env bash
# make run-kube-apiserver: etcd, the local KMS v2 plugin and bin/kube-apiserver (kube-apiserver
# v1.37.2 with rekey inside) with the smallest set of flags it starts with, a sample
# encryption config (Secrets: KMS v2, ConfigMaps: aesgcm, automatic reload on) and a
# kubeconfig. It serves on loopback only, so the kubernetes Service gets no endpoints
# (--endpoint-reconciler-type none: loopback addresses cannot be advertised). Ctrl-C stops all three. State lives in $RUN_DIR (default
# /tmp/rekey-kube-apiserver); delete it to start over with fresh keys and data.
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_DIR=${RUN_DIR:-/tmp/rekey-kube-apiserver}
PORT=${PORT:-6443}
ETCD_PORT=${ETCD_PORT:-23790}
BIN=${BIN:-bin}

[ -x "$BIN/kube-apiserver" ] || { echo "!! $BIN/kube-apiserver missing: run make kube-apiserver"; exit 1; }
echo ">> building $BIN/etcd and $BIN/kms-plugin"
go build -o "$BIN/" ./hack/tools/etcd ./cmd/kms-plugin

mkdir -p "$RUN_DIR"
chmod 700 "$RUN_DIR"
SOCK="$RUN_DIR/kms.sock"
KEYS="$RUN_DIR/kms-keys.yaml"
CONFIG="$RUN_DIR/encryption.yaml"
TOKENS="$RUN_DIR/tokens.csv"
SA_KEY="$RUN_DIR/sa.key"
KUBECONFIG_FILE="$RUN_DIR/kubeconfig"
rand32() { head -c 32 /dev/urandom | base64; }

if [ ! -f "$KEYS" ]; then
  printf 'keys:\n- name: kek-1\n  secret: %s\n' "$(rand32)" > "$KEYS"
fi
if [ ! -f "$CONFIG" ]; then
  cat > "$CONFIG" <<YAML
apiVersion: apiserver.config.k8s.io/v1
kind: EncryptionConfiguration
resources:
- resources: [secrets]
  providers:
  - kms:
      apiVersion: v2
      name: local-plugin
      endpoint: unix://$SOCK
      timeout: 3s
  - identity: {}
- resources: [configmaps]
  providers:
  - aesgcm:
      keys:
      - name: key1
        secret: $(rand32)
  - identity: {}
YAML
fi
if [ ! -f "$TOKENS" ]; then
  echo "$(head -c 24 /dev/urandom | base64 | tr -d '/+='),admin,admin,\"system:masters\"" > "$TOKENS"
fi
# The service-account token signing key (kube-apiserver refuses to start without one).
[ -f "$SA_KEY" ] || openssl ecparam -name prime256v1 -genkey -noout -out "$SA_KEY" 2>/dev/null
chmod 600 "$KEYS" "$CONFIG" "$TOKENS" "$SA_KEY"
TOKEN=$(cut -d, -f1 "$TOKENS")

PIDS=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  echo ">> stopped"
}
trap cleanup EXIT INT TERM

ETCD_URL="http://127.0.0.1:$ETCD_PORT"
PEER_URL="http://127.0.0.1:$((ETCD_PORT + 1))"
"$BIN/etcd" --name rekey --data-dir "$RUN_DIR/etcd" \
  --listen-client-urls "$ETCD_URL" --advertise-client-urls "$ETCD_URL" \
  --listen-peer-urls "$PEER_URL" --initial-advertise-peer-urls "$PEER_URL" \
  --initial-cluster "rekey=$PEER_URL" --log-level warn > "$RUN_DIR/etcd.log" 2>&1 &
PIDS+=($!)
"$BIN/kms-plugin" --listen-addr "unix://$SOCK" --keys-file "$KEYS" > "$RUN_DIR/kms-plugin.log" 2>&1 &
PIDS+=($!)

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

CA="$RUN_DIR/certs/apiserver.crt"
for _ in $(seq 1200); do
  if ! kill -0 "$APISERVER_PID" 2>/dev/null; then
    echo "!! kube-apiserver exited; last lines of $RUN_DIR/kube-apiserver.log:"; tail -20 "$RUN_DIR/kube-apiserver.log"; exit 1
  fi
  [ -f "$CA" ] && curl -sf --cacert "$CA" -H "Authorization: Bearer $TOKEN" "https://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && break
  sleep 0.1
done
READY_MS=$(( ($(date +%s%N) - START) / 1000000 ))

cat > "$KUBECONFIG_FILE" <<KC
apiVersion: v1
kind: Config
clusters:
- name: rekey-kube-apiserver
  cluster: {server: "https://127.0.0.1:$PORT", certificate-authority: "$CA"}
users:
- name: admin
  user: {token: "$TOKEN"}
contexts:
- name: rekey-kube-apiserver
  context: {cluster: rekey-kube-apiserver, user: admin}
current-context: rekey-kube-apiserver
KC
chmod 600 "$KUBECONFIG_FILE"

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
