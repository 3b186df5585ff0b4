#!/usr/bin/env bash
# The default test run's tests (`make test` runs the linters first), in two phases:
#
#   race:   go test -race ./pkg/..., alone: the race detector's runs of the pacing and
#           readiness tests are timing-sensitive, and on two cores they failed now and
#           then when everything else ran beside them;
#   then at once:
#   e2e:    go test ./test/e2e (its tests run one after the other);
#   other:  every other package of the module, then dist/kube-apiserver's and
#           deploy/monitoring's own modules.
#
set -uo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
logs=${TEST_LOG_DIR:-bin/test-logs}
rm -rf "$logs"
mkdir -p "$logs"

others=$($GO list ./... | grep -v -e '/pkg/' -e '/test/e2e$')

group_race() { $GO test -race -count=1 -v -timeout 20m ./pkg/...; }
group_e2e() { $GO test -count=1 -v -timeout 45m ./test/e2e; }
group_other() {
	local rc=0
	# shellcheck disable=SC2086 # one argument per package
	$GO test -count=1 -v -timeout 30m $others || rc=1
	if [ "${REKEY_SKIP_KUBE_APISERVER:-}" != 1 ]; then
		(cd dist/kube-apiserver && $GO test -count=1 -v .) || rc=1
	fi
	# deploy/monitoring: the alert rules and dashboard checked against running shims.
	(cd deploy/monitoring && $GO test -count=1 -v -timeout 10m .) || rc=1
	return $rc
}

run_group() {
	local g=$1 s
	s=$(date +%s)
	"group_$g" >"$logs/$g.log" 2>&1
	echo "$? $(($(date +%s) - s))" >"$logs/$g.result"
}

start=$(date +%s)
run_group race
run_group e2e &
e2e=$!
run_group other
wait "$e2e"

failed=0
echo
echo "== test groups (wall time; race first, then e2e and other at once)"
for g in race e2e other; do
	read -r rc secs <"$logs/$g.result"
	status=ok
	if [ "$rc" != 0 ]; then status=FAIL failed=1; fi
	printf '%-6s %-5s %4ds   %s\n' "$g" "$status" "$secs" "$logs/$g.log"
done
echo "total: $(($(date +%s) - start))s"

echo
echo "== slowest tests"
grep -h -E '^\s*--- (PASS|FAIL): [^ ]+ \([0-9.]+s\)' "$logs"/*.log | grep -v '^\s\s' |
	sed -E 's/^\s*--- (PASS|FAIL): ([^ ]+) \(([0-9.]+)s\)/\3 \1 \2/' | sort -rn | head -15

if [ "$failed" != 0 ]; then
	echo
	echo "== failures"
	for g in race e2e other; do
		read -r rc _ <"$logs/$g.result"
		[ "$rc" = 0 ] && continue
		echo "---- $g ($logs/$g.log): failing tests and package results"
		grep -n -E '^(--- FAIL|FAIL|ok |panic:)|^\s+--- FAIL' "$logs/$g.log" | head -40
		echo "---- $g: the first failure's output"
		awk '/^=== RUN/ {buf=""} {buf = buf $0 "\n"} /^--- FAIL/ {printf "%s", buf; exit}' "$logs/$g.log" |
			grep -v 'addrConn.createTransport' | tail -150
		echo "---- $g: last lines"
		tail -30 "$logs/$g.log"
	done
	exit 1
fi
