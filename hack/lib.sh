#!/usr/bin/env bash
# Shared by hack/run.sh (make run) and hack/run-kube-apiserver.sh (make run-kube-apiserver):
# the run directory, keys, sample config, token, cleanup, readiness wait and kubeconfig.
# Source it after setting RUN_DIR, PORT and BIN.

rand32() { head -c 32 /dev/urandom | base64; }

# prepare_run_dir creates $RUN_DIR (private) with the plugin's keyring, a sample
# EncryptionConfiguration (Secrets: KMS v2, ConfigMaps: aesgcm) and a token file, each
# kept when it exists, and sets SOCK KEYS CONFIG TOKENS KUBECONFIG_FILE TOKEN.
prepare_run_dir() {
  mkdir -p "$RUN_DIR"
  chmod 700 "$RUN_DIR"
  SOCK="$RUN_DIR/kms.sock"
  KEYS="$RUN_DIR/kms-keys.yaml"
  CONFIG="$RUN_DIR/encryption.yaml"
  TOKENS="$RUN_DIR/tokens.csv"
  KUBECONFIG_FILE="$RUN_DIR/kubeconfig"
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
}

# PIDS collects background processes; Ctrl-C or exit stops them all.
PIDS=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  echo ">> stopped"
}
trap cleanup EXIT INT TERM

start_plugin() {
  "$BIN/kms-plugin" --listen-addr "unix://$SOCK" --keys-file "$KEYS" > "$RUN_DIR/kms-plugin.log" 2>&1 &
  PIDS+=($!)
}

# wait_ready NAME PID LOG TRIES [curl args…]: polls /readyz every 0.1 s until it answers,
# failing with the log's tail if the process exits; sets CA and READY_MS (from START).
wait_ready() {
  local name=$1 pid=$2 log=$3 tries=$4
  shift 4
  CA="$RUN_DIR/certs/apiserver.crt"
  for _ in $(seq "$tries"); do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "!! $name exited; last lines of $log:"; tail -20 "$log"; exit 1
    fi
    [ -f "$CA" ] && curl -sf --cacert "$CA" "$@" "https://127.0.0.1:$PORT/readyz" >/dev/null 2>&1 && break
    sleep 0.1
  done
  READY_MS=$(( ($(date +%s%N) - START) / 1000000 ))
}

# write_kubeconfig NAME: an admin kubeconfig for the server on $PORT.
write_kubeconfig() {
  cat > "$KUBECONFIG_FILE" <<KC
apiVersion: v1
kind: Config
clusters:
- name: $1
  cluster: {server: "https://127.0.0.1:$PORT", certificate-authority: "$CA"}
users:
- name: admin
  user: {token: "$TOKEN"}
contexts:
- name: $1
  context: {cluster: $1, user: admin}
current-context: $1
KC
  chmod 600 "$KUBECONFIG_FILE"
}
