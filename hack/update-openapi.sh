#!/usr/bin/env bash
# Regenerates internal/shim/openapi from the k8s.io/api and apimachinery versions in go.mod.
# The apiserver shim needs OpenAPI definitions: server-side apply and kubectl's client-side
# validation read them. Run after bumping k8s.io/api; the output is committed.
#
# hack/update-openapi.sh --verify regenerates into a temporary directory and fails when
# the committed file differs (make lint runs it).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=internal/shim/openapi
OUT_FILE=zz_generated.openapi.go
verify=false
[[ "${1:-}" == "--verify" ]] && verify=true

# Pin the generator to the kube-openapi version the module graph already selects; it is
# installed once per version under bin/tools (ignored by git), like make's lint tools.
KUBE_OPENAPI_VERSION=$(go list -m -f '{{.Version}}' k8s.io/kube-openapi)
GEN_DIR="$PWD/bin/tools/openapi-gen-${KUBE_OPENAPI_VERSION}"
[[ -x "$GEN_DIR/openapi-gen" ]] || GOBIN="$GEN_DIR" go install "k8s.io/kube-openapi/cmd/openapi-gen@${KUBE_OPENAPI_VERSION}"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

PKGS=(
  k8s.io/api/core/v1
  ./api/v1alpha1
  k8s.io/apimachinery/pkg/apis/meta/v1
  k8s.io/apimachinery/pkg/runtime
  k8s.io/apimachinery/pkg/version
  k8s.io/apimachinery/pkg/util/intstr
  k8s.io/apimachinery/pkg/api/resource
)
readonly_args=()
for p in "${PKGS[@]}"; do [[ $p == ./* ]] || readonly_args+=(--readonly-pkg "$p"); done

dest="./$OUT_DIR"
$verify && dest="$TMP/out"

# --readonly-pkg keeps the generator from writing model-name files into the module cache.
"$GEN_DIR/openapi-gen" \
  --output-dir "$dest" \
  --output-pkg "github.com/rekey-io/rekey/$OUT_DIR" \
  --output-file "$OUT_FILE" \
  --go-header-file hack/boilerplate.go.txt \
  --report-filename /dev/null \
  "${readonly_args[@]}" \
  "${PKGS[@]}"

if $verify; then
  if ! diff -q "$OUT_DIR/$OUT_FILE" "$dest/$OUT_FILE" >/dev/null; then
    echo "$OUT_DIR/$OUT_FILE is out of date: run hack/update-openapi.sh and commit the result" >&2
    exit 1
  fi
  exit 0
fi
echo "regenerated $OUT_DIR/$OUT_FILE"
