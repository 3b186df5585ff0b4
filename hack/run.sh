#!/usr/bin/env bash
# make run: the local KMS v2 plugin and the apiserver shim with embedded etcd, a sample
# encryption config (Secrets: KMS v2, ConfigMaps: aesgcm) and a kubeconfig.
# Ctrl-C stops both. State lives in $RUN_DIR (default /tmp/rekey-run); delete it to
# start over with fresh keys and data.
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_DIR=${RUN_DIR:-/tmp/rekey-run}
PORT=${PORT:-6443}
BIN=${BIN:-bin}
VERSION_LDFLAGS="-X k8s.io/component-base/version.gitVersion=v1.37.2 -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37"

echo ">> building $BIN/apiserver-shim and $BIN/kms-plugin (the first build takes a few minutes)"
go build -ldflags "$VERSION_LDFLAGS" -o "$BIN/" ./cmd/apiserver-shim ./cmd/kms-plugin

mkdir -p "$RUN_DIR"
chmod 700 "$RUN_DIR"
SOCK="$RUN_DIR/kms.sock"
KEYS="$RUN_DIR/kms-keys.yaml"
CONFIG="$RUN_DIR/encryption.yaml"
TOKENS="$RUN_DIR/tokens.csv"
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
chmod 600 "$KEYS" "$CONFIG" "$TOKENS"
TOKEN=$(cut -d, -f1 "$TOKENS")

PIDS=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  echo ">> stopped"
}
trap cleanup EXIT INT TERM

"$BIN/kms-plugin" --listen-addr "unix://$SOCK" --keys-file "$KEYS" > "$RUN_DIR/kms-plugin.log" 2>&1 &
PIDS+=($!)

START=$(date +%s%N)
"$BIN/apiserver-shim" \
  --encryption-provider-config "$CONFIG" \
  --token-auth-file "$TOKENS" \
  --data-dir "$RUN_DIR/data" --cert-dir "$RUN_DIR/certs" \
  --secure-port "$PORT" > "$RUN_DIR/apiserver-shim.log" 2>&1 &
SHIM_PID=$!
PIDS+=($SHIM_PID)

CA="$RUN_DIR/certs/apiserver.crt"
for _ in $(seq 300); do
  if ! kill -0 "$SHIM_PID" 2>/dev/null; then
    echo "!! apiserver-shim exited; last lines of $RUN_DIR/apiserver-shim.log:"; tail -20 "$RUN_DIR/apiserver-shim.log"; exit 1
  fi
  [ -f "$CA" ] && curl -sf --cacert "$CA" "https://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && break
  sleep 0.1
done
READY_MS=$(( ($(date +%s%N) - START) / 1000000 ))

cat > "$KUBECONFIG_FILE" <<KC
apiVersion: v1
kind: Config
clusters:
- name: rekey-shim
  cluster: {server: "https://127.0.0.1:$PORT", certificate-authority: "$CA"}
users:
- name: admin
  user: {token: "$TOKEN"}
contexts:
- name: rekey-shim
  context: {cluster: rekey-shim, user: admin}
current-context: rekey-shim
KC
chmod 600 "$KUBECONFIG_FILE"

cat <<MSG

rekey apiserver-shim is ready on https://127.0.0.1:$PORT (ready ${READY_MS} ms after start)
  embedded etcd data: $RUN_DIR/data        logs: $RUN_DIR/{apiserver-shim,kms-plugin}.log
  Secrets are encrypted with KMS v2 (plugin at $SOCK), ConfigMaps with aesgcm.

Use it:
  export KUBECONFIG=$KUBECONFIG_FILE
  kubectl create secret generic demo --from-literal=password=hunter2
  kubectl create configmap settings --from-literal=mode=demo
  kubectl get secrets,cm
  curl -s --cacert $CA -H "Authorization: Bearer $TOKEN" https://127.0.0.1:$PORT/rekey/status
  curl -s --cacert $CA https://127.0.0.1:$PORT/readyz?verbose

Watch a hot reload (no restart): edit $CONFIG, e.g. put a new key first under aesgcm:
      - name: key2
        secret: $(rand32)
  then create a configmap and look at the status document: new writes use key2, old
  values stay readable; a broken edit is rejected and the server keeps serving.

Rotate the plugin key: put a new key first in $KEYS (the first key is active), e.g.
  sed -i "1a - name: kek-2\\n  secret: \$(head -c 32 /dev/urandom | base64)" $KEYS
  New Secrets are then written under kek-2 within 15 s (next Status call, --kms-status-interval); old ones
  still decrypt, and the shim re-encrypts them under kek-2 by itself (storage migration:
  see "storage" in the status document).

Ctrl-C stops the plugin and the shim.
MSG

wait "$SHIM_PID"
