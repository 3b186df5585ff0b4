#!/usr/bin/env bash
# Every package directory at the top of api/, pkg/, internal/, cmd/ and plugins/ is named in README.md's
# and DESIGN.md's layout tables (a sub-package is covered by its parent's row), so that
# someone new can read the layout as the architecture. Run by `make lint`.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=0
for dir in $(find api pkg internal cmd plugins -mindepth 1 -maxdepth 1 -type d | sort); do
	ls "$dir"/*.go >/dev/null 2>&1 || [ -n "$(find "$dir" -name '*.go' -print -quit)" ] || continue
	for doc in README.md DESIGN.md; do
		if ! grep -q "\`$dir\`" "$doc"; then
			echo "$doc does not name $dir in backquotes: add it to the layout table"
			missing=1
		fi
	done
done
exit $missing
