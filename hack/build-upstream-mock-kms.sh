#!/usr/bin/env bash
# Builds upstream's mock KMS v2 plugin on PKCS#11 (github.com/kubernetes/kms,
# internal/plugins/_mock: module k8s.io/kms/plugins/mock, one AES key labelled
# "kms-test" on a SoftHSM2 token named in a JSON config file) into $1 (default
# bin/upstream-mock-kms-plugin), from upstream's own source at a pinned commit. None of
# its code is kept in this repository: the source is exported into a temporary
# directory, built there and deleted.
#
# Upstream's go.mod points k8s.io/kms at the staging tree (replace k8s.io/kms =>
# ../../../../kms); the export drops that replace and requires the k8s.io/kms version
# this repository's go.mod uses, from the module proxy, instead.
#
#   KMS_SRC     a git directory of github.com/kubernetes/kms to export from (default: a
#               clone of KMS_REPO made in the temporary directory)
#   KMS_REPO    default https://github.com/kubernetes/kms.git
#   KMS_COMMIT  the commit to build (default: the pinned one below)
#
# Needs cgo (crypto11 on miekg/pkcs11 loads the PKCS#11 library at run time).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-bin/upstream-mock-kms-plugin}")
commit=${KMS_COMMIT:-7dc88c042aa2916629d29cb4744e5e76ce418b77}
kms_version=$(sed -n 's|^\tk8s.io/kms \(v[^ ]*\).*|\1|p' go.mod | head -1)
[ -n "$kms_version" ] || { echo "go.mod requires no k8s.io/kms" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
src=${KMS_SRC:-}
if [ -z "$src" ]; then
	git clone --quiet --no-checkout "${KMS_REPO:-https://github.com/kubernetes/kms.git}" "$work/kms"
	src="$work/kms"
fi
mkdir "$work/export"
git -C "$src" archive "$commit" internal/plugins/_mock | tar -x -C "$work/export"
mod="$work/export/internal/plugins/_mock"
# The staging tree's workspace file and replace: neither exists outside k8s.io/kubernetes.
rm -f "$mod/go.work" "$mod/go.work.sum"
(
	cd "$mod"
	go mod edit -dropreplace k8s.io/kms -require "k8s.io/kms@$kms_version"
	GOWORK=off GOFLAGS=-mod=mod go mod tidy
	GOWORK=off CGO_ENABLED=1 go build -trimpath -o "$out" .
)
echo "built $out (k8s.io/kms/plugins/mock at kubernetes/kms $commit, k8s.io/kms $kms_version)"
