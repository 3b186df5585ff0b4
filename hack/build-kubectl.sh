#!/usr/bin/env bash
# Builds kubectl v1.37.2 into $1 (default bin/kubectl) for a machine that has none; .ci/run
# calls it. kubectl lives in k8s.io/kubectl, which dist/kube-apiserver's module graph
# already pins (k8s.io/kubernetes v1.37.2 and its staging modules), but that module's
# go.sum lacks a few of kubectl's own dependencies. So the build runs in a throwaway
# module made of dist's go.mod and go.sum, where -mod=mod may add them, and the
# repository's files stay untouched.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-bin/kubectl}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp dist/kube-apiserver/go.mod dist/kube-apiserver/go.sum "$work/"
# The throwaway module does not need rekey itself (dist's replace points at ../..).
sed -i -e 's|^module .*|module kubectl-build|' -e '/rekey-io\/rekey/d' "$work/go.mod"
mkdir "$work/kubectl"
cat > "$work/kubectl/main.go" <<'GO'
package main

import (
	"k8s.io/component-base/cli"
	"k8s.io/kubectl/pkg/cmd"
	"k8s.io/kubectl/pkg/cmd/util"
)

func main() {
	if err := cli.RunNoErrOutput(cmd.NewDefaultKubectlCommand()); err != nil {
		util.CheckErr(err)
	}
}
GO
version=$(sed -n 's|^\tk8s.io/kubernetes v1\.\([0-9]*\)\.\([0-9]*\).*|v1.\1.\2|p' "$work/go.mod" | head -1)
ldflags="-X k8s.io/component-base/version.gitVersion=${version:-v1.37.2}"
(cd "$work" && GOFLAGS=-mod=mod go build -ldflags "$ldflags" -o "$out" ./kubectl)
echo "built $out ($("$out" version --client 2>/dev/null | head -1))"
