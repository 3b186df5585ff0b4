#!/usr/bin/env bash
# Regenerates pkg/generated/openapi from the k8s.io/api and apimachinery versions in go.mod.
# The apiserver shim needs OpenAPI definitions: server-side apply and kubectl's client-side
# validation read them. Run only after bumping k8s.io/api; the output is committed.
set -euo pipefail
cd "$(dirname "$0")/.."

# Pin the generator to the kube-openapi version the module graph already selects.
KUBE_OPENAPI_VERSION=$(go list -m -f '{{.Version}}' k8s.io/kube-openapi)
GOBIN_DIR=$(mktemp -d)
trap 'rm -rf "$GOBIN_DIR"' EXIT
GOBIN="$GOBIN_DIR" go install "k8s.io/kube-openapi/cmd/openapi-gen@${KUBE_OPENAPI_VERSION}"

PKGS=(
  k8s.io/api/core/v1
  k8s.io/apimachinery/pkg/apis/meta/v1
  k8s.io/apimachinery/pkg/runtime
  k8s.io/apimachinery/pkg/version
  k8s.io/apimachinery/pkg/util/intstr
  k8s.io/apimachinery/pkg/api/resource
)
readonly_args=()
for p in "${PKGS[@]}"; do readonly_args+=(--readonly-pkg "$p"); done

# --readonly-pkg keeps the generator from writing model-name files into the module cache.
"$GOBIN_DIR/openapi-gen" \
  --output-dir ./pkg/generated/openapi \
  --output-pkg github.com/rekey-io/rekey/pkg/generated/openapi \
  --output-file zz_generated.openapi.go \
  --go-header-file hack/boilerplate.go.txt \
  --report-filename /dev/null \
  "${readonly_args[@]}" \
  "${PKGS[@]}"
echo "regenerated pkg/generated/openapi/zz_generated.openapi.go"
