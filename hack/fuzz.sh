#!/usr/bin/env bash
# make fuzz: run every Go fuzz target in the module for a bounded time each.
# FUZZTIME (default 20s) bounds each target; PKGS narrows the packages (default ./...).
set -euo pipefail
cd "$(dirname "$0")/.."
fuzztime=${FUZZTIME:-20s}
pkgs=${PKGS:-./...}
status=0
for pkg in $(go list $pkgs); do
  targets=$(go test -list '^Fuzz' "$pkg" 2>/dev/null | grep '^Fuzz' || true)
  for t in $targets; do
    echo "== $pkg $t ($fuzztime)"
    if ! go test -run '^$' -fuzz "^${t}\$" -fuzztime "$fuzztime" "$pkg"; then
      status=1
    fi
  done
done
exit $status
