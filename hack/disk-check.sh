#!/usr/bin/env bash
# Says how much disk the test run has, removes what earlier runs of this project's tests
# and benchmarks left in the temp dir (a run that was killed cannot remove its own etcd
# data dirs), and refuses to start when too little is left for the run to finish.
#
# The default test run used 2.5 GiB under the temp dir at a peak (the four test
# groups' etcd clusters) and, cold, about 10 GiB for the Go build cache (GOCACHE) and
# 3 GiB for the module cache.
set -uo pipefail
tmp=${TMPDIR:-/tmp}
min_free_mib=${REKEY_MIN_FREE_MIB:-4096}

free_mib() { df -Pm "$1" 2>/dev/null | awk 'NR==2 {print $4}'; }

# Leftovers: the benchmarks' scratch dirs (internal/bench), the etcd test fixtures'
# (internal/etcdtest, internal/etcdsnapshot, cmd/rekey), and Go test temp dirs that
# hold an etcd data dir, all older than an hour (a run going on beside this one keeps
# its own).
removed=0
while IFS= read -r -d '' d; do
	rm -rf -- "$d" && removed=$((removed + 1))
done < <(find "$tmp" -maxdepth 1 -mindepth 1 -type d -mmin +60 \
	\( -name 'rkr*' -o -name 'rkb*' -o -name 'rka*' -o -name 'rekey-bench*' -o -name 'rekey-etcdtest-*' \
	-o -name 'rekey-snapshot-*' -o -name 'rekey-etcd-tls-*' \) -print0 2>/dev/null)
while IFS= read -r -d '' d; do
	if find "$d" -maxdepth 4 -type d -name member -print -quit 2>/dev/null | grep -q .; then
		rm -rf -- "$d" && removed=$((removed + 1))
	fi
done < <(find "$tmp" -maxdepth 1 -mindepth 1 -type d -mmin +60 -name 'Test*' -print0 2>/dev/null)
[ "$removed" -gt 0 ] && echo "disk: removed $removed directories earlier test or benchmark runs left in $tmp"

gocache=$(go env GOCACHE 2>/dev/null || echo "$HOME/.cache/go-build")
mkdir -p "$gocache" 2>/dev/null
tmp_free=$(free_mib "$tmp")
cache_free=$(free_mib "$gocache")
echo "disk: ${tmp_free:-?} MiB free under $tmp (etcd data of the tests), ${cache_free:-?} MiB under $gocache (Go build cache)"
for pair in "$tmp:$tmp_free" "$gocache:$cache_free"; do
	dir=${pair%:*} free=${pair##*:}
	if [ -n "$free" ] && [ "$free" -lt "$min_free_mib" ]; then
		echo "disk: only $free MiB free under $dir; the test run needs at least $min_free_mib MiB there (etcd fails with 'no space left on device' otherwise)." >&2
		echo "disk: free some space (go clean -cache empties the Go build cache; the next build is then cold) or set REKEY_MIN_FREE_MIB to run anyway." >&2
		exit 1
	fi
done
exit 0
