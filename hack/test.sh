#!/usr/bin/env bash
# The default test run's tests (`make test` runs the linters first). Four groups run
# at once, because they wait on different things: the process-level e2e package spends
# most of its time waiting (for kubelet-like file syncs, leases, paced migrations), while
# the race-detector run of ./pkg/... and the other packages keep the cores busy
# meanwhile. The e2e package is the longest (its tests run one after the other, ~1,150 s
# in all), so it runs as two processes of about equal length: the many-apiserver
# scenarios ($cluster_tests) and the rest.
#
#   race:    go test -race ./pkg/... (the heap-bound test skips itself under -race, and
#            pkg/migrate's rotation scenario runs a twentieth of its 10,000 objects),
#            then deploy/monitoring's and plugins/kms-pkcs11's own modules (the last
#            needs SoftHSM2: .ci/run installs it)
#   cluster: go test -run "$cluster_tests" ./test/e2e
#   e2e:     go test -skip "$cluster_tests|$controller_test" ./test/e2e
#   other:   every other package of the module, pkg/migrate's heap-bound test and its
#            10,000-object rotation scenario without -race, the e2e package's controller scenario
#            ($controller_test: it balances the groups), then dist/kube-apiserver's own
#            module
# Each step's time is in its group's log ("== step").
#
# The testbed's programs (the shim, etcd, the KMS plugin, rekey, dist/kube-apiserver
# and upstream's kube-apiserver) are built once into bin/test-bins by
# hack/tools/testbins, and every group takes them from there ($REKEY_TESTBED_PREBUILT).
#
# Tests must hold under this load: one that fails only beside the others is a bug to
# find (a starved goroutine taken for a paused process, a command started before its
# fixture), not a reason to run the groups one after the other.
#
# Each group's verbose output goes to $TEST_LOG_DIR (default bin/test-logs)/<group>.log.
# At the end the script prints each group's time, the slowest tests of the run, and the
# failures with their output; it exits non-zero when any group failed.
set -uo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
logs=${TEST_LOG_DIR:-bin/test-logs}
rm -rf "$logs"
mkdir -p "$logs"

others=$($GO list ./... | grep -v -e '/pkg/' -e '/test/e2e$')

# step runs one command of a group and says, in the group's log, how long it took.
step() {
	local s rc
	s=$(date +%s)
	"$@"
	rc=$?
	echo "== step (${*: -1}): exit $rc after $(($(date +%s) - s))s"
	return $rc
}

# The race run ends first (585 s of a run whose other groups took 600-700 s; 343 s
# when it ran beside less), so the other modules' steps follow it: with
# pkg/migrate's heavy tests here too, the group took 725 s, the run's longest.
group_race() {
	local rc=0
	step $GO test -race -count=1 -v -timeout 20m ./pkg/... || rc=1
	# deploy/monitoring: the alert rules and dashboard checked against running shims.
	(cd deploy/monitoring && step $GO test -count=1 -v -timeout 10m .) || rc=1
	# plugins/kms-pkcs11: the PKCS#11 plugin against SoftHSM2 tokens (they fail without it).
	(cd plugins/kms-pkcs11 && step $GO test -count=1 -v -timeout 10m ./...) || rc=1
	return $rc
}
# The TestCluster scenarios (~540 s under the suite's load) and a scenario on a 3-member
# etcd from a Secret (~40 s); the rest of the package but the controller scenario is
# ~550 s.
cluster_tests='^(TestCluster|TestRotateWaitFromASecret$)'
controller_test='^TestControllerRotatesDeclaredRotations$'
group_cluster() { $GO test -count=1 -v -timeout 45m -run "$cluster_tests" ./test/e2e; }
group_e2e() { $GO test -count=1 -v -timeout 45m -skip "$cluster_tests|$controller_test" ./test/e2e; }
group_other() {
	local rc=0
	# shellcheck disable=SC2086 # one argument per package
	step $GO test -count=1 -v -timeout 30m $others || rc=1
	step $GO test -count=1 -v -timeout 10m -run '^(TestLargeObjectsStayWithinMemoryBound|TestRotationScenario)$' ./pkg/migrate || rc=1
	step $GO test -count=1 -v -timeout 15m -run "$controller_test" ./test/e2e || rc=1
	if [ "${REKEY_SKIP_KUBE_APISERVER:-}" != 1 ]; then
		(cd dist/kube-apiserver && step $GO test -count=1 -v .) || rc=1
	fi
	return $rc
}

groups="cluster e2e race other"

run_group() {
	local g=$1 s
	s=$(date +%s)
	"group_$g" >"$logs/$g.log" 2>&1
	echo "$? $(($(date +%s) - s))" >"$logs/$g.result"
}

# The testbed's programs are built once, for every group (testbed.PrebuiltEnv), beside
# them: each e2e process built the shim, etcd, the plugin and rekey on its own, and two
# of them dist/kube-apiserver and upstream's kube-apiserver at once (3 minutes of both
# cores in a run of 1,601 s). A test that needs a set waits until it is ready, and
# builds it itself if the prebuild ended without it.
start=$(date +%s)
export REKEY_TESTBED_PREBUILT=$PWD/bin/test-bins
rm -rf "$REKEY_TESTBED_PREBUILT"
prebuild_sets=servers
[ "${REKEY_SKIP_KUBE_APISERVER:-}" != 1 ] && prebuild_sets="servers kube-apiserver"
# shellcheck disable=SC2086 # one argument per set
# The done marker (testbed.DoneMarker) is written whatever happens to the command (it
# writes it itself on its own failures), so that no test waits for a build that ended.
(
	$GO run ./hack/tools/testbins "$REKEY_TESTBED_PREBUILT" $prebuild_sets >"$logs/testbins.log" 2>&1
	rc=$?
	mkdir -p "$REKEY_TESTBED_PREBUILT" && touch "$REKEY_TESTBED_PREBUILT/.done"
	exit $rc
) &
prebuild=$!
pids=()
for g in $groups; do
	run_group "$g" &
	pids+=($!)
done
wait "${pids[@]}"
wait "$prebuild" || echo "building the testbed's programs failed; the tests built their own:"
cat "$logs/testbins.log"

failed=0
echo
echo "== test groups (wall time; they ran at once)"
for g in $groups; do
	read -r rc secs <"$logs/$g.result"
	status=ok
	if [ "$rc" != 0 ]; then status=FAIL failed=1; fi
	printf '%-6s %-5s %4ds   %s\n' "$g" "$status" "$secs" "$logs/$g.log"
done
echo "total: $(($(date +%s) - start))s"
for g in $groups; do
	grep -h '^== step' "$logs/$g.log" | sed "s/^== step/  $g:/"
done

echo
echo "== slowest tests"
grep -h -E '^\s*--- (PASS|FAIL): [^ ]+ \([0-9.]+s\)' "$logs"/*.log | grep -v '^\s\s' |
	sed -E 's/^\s*--- (PASS|FAIL): ([^ ]+) \(([0-9.]+)s\)/\3 \1 \2/' | sort -rn | head -15

if [ "$failed" != 0 ]; then
	echo
	echo "== failures"
	for g in $groups; do
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
	# Last, and short, because a CI report may keep only the output's last lines: each
	# failed group's failing tests with the last line the test reported before it
	# failed (its t.Logf lines come first, its error usually last; the log tails of its
	# cleanups after it are skipped), panics and timeouts.
	echo
	echo "== failed (details above)"
	for g in $groups; do
		read -r rc secs <"$logs/$g.result"
		[ "$rc" = 0 ] && continue
		echo "$g: exit $rc after ${secs}s"
		awk '/^=== RUN/ {last=""}
			/^ +[^ ]+_test\.go:[0-9]+:/ && !/log tail|logs?:$/ {last=$0}
			/^ *--- FAIL/ {sub(/^ +/, "", last); printf "  %s  %s\n", $0, substr(last, 1, 240); last=""}
			/^panic:|^FAIL\t|test timed out/ {print "  " substr($0, 1, 240)}' "$logs/$g.log" | head -12
	done
	exit 1
fi
