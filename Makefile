# rekey — see README.md. Two commands matter: `make run` and `make test`.
SHELL := /bin/bash
GO ?= go
export PATH := $(shell $(GO) env GOROOT 2>/dev/null)/bin:$(PATH)

BIN := bin
# Lint tools, pinned; `make tools` installs them under bin/tools/<version>/.
STATICCHECK_VERSION := v0.8.2
STATICCHECK := $(BIN)/tools/staticcheck-$(STATICCHECK_VERSION)/staticcheck
VERSION_LDFLAGS := -X k8s.io/component-base/version.gitVersion=v1.37.2 -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37

.PHONY: test-fips kms-pkcs11 test-kms-pkcs11 upstream-mock-kms bench-kms-pkcs11-rotation all build test lint docs-check fmt vet staticcheck tidy-check openapi-check tools run e2e e2e-long bench bench-rotation bench-controller bench-scale charts bench-go fuzz sim clean kube-apiserver run-kube-apiserver

# dist/kube-apiserver: upstream's kube-apiserver with rekey inside, a Go module of its own.
KUBE_VERSION := v1.37.2
REKEY_VERSION := $(shell git describe --always --dirty 2>/dev/null || echo devel)
KUBE_LDFLAGS := $(VERSION_LDFLAGS) -X k8s.io/component-base/version.gitTreeState=clean \
	-X k8s.io/component-base/version.buildDate=$(shell date -u +%Y-%m-%dT%H:%M:%SZ) \
	-X main.rekeyVersion=$(REKEY_VERSION)

all: build

build:
	$(GO) build -ldflags "$(VERSION_LDFLAGS)" -o $(BIN)/ ./cmd/...

## test: the default test run (CI runs this): lint, then the tests (hack/test.sh): ./pkg/...
## under the race detector first, then the process-level e2e package beside every other
## package and module (dist/kube-apiserver, deploy/monitoring); verbose logs in bin/test-logs,
## the slowest tests printed at the end.
test: lint
	bash hack/softhsm.sh
	GO=$(GO) bash hack/test.sh

## test-fips: the unit and end-to-end suites in FIPS 140-3 mode (not part of `make test`;
## docs/fips.md). Unit: every package but test/e2e, built with GOFIPS140=$(FIPS_MODULE) and run with
## GODEBUG=$(FIPS_GODEBUG), one package at a time (etcd, which cannot run under fips140=only,
## runs as a process of a build without the module: REKEY_ETCDTEST_BIN). End-to-end: test/e2e
## with REKEY_TESTBED_FIPS=1, so the shim, the KMS plugin and rekey are GOFIPS140 builds run
## with GODEBUG=fips140=only (etcd and kubectl outside it; the test process reads etcd with
## upstream's transformers, which cannot run in that mode). FIPS_E2E_SKIP leaves out the
## tests on kube-apiserver (dist/kube-apiserver, all of k8s.io/kubernetes, would be recompiled with the module);
## FIPS_UNIT_PKGS, FIPS_E2E_RUN narrow the runs; logs in bin/test-logs/fips-*.log.
FIPS_MODULE ?= v1.0.0
FIPS_GODEBUG ?= fips140=only
FIPS_UNIT_PKGS ?= $(shell $(GO) list ./... | grep -v '/test/e2e$$')
FIPS_E2E_RUN ?= .
FIPS_E2E_SKIP ?= KubeAPIServer|TestControllerRotatesDeclaredRotations
test-fips:
	@mkdir -p $(BIN)/test-logs $(BIN)/fips
	GOFIPS140=off $(GO) build -o $(BIN)/fips/etcd ./hack/tools/etcd
	@start=$$(date +%s); \
	REKEY_ETCDTEST_BIN=$(CURDIR)/$(BIN)/fips/etcd GOFIPS140=$(FIPS_MODULE) GODEBUG=$(FIPS_GODEBUG) \
		$(GO) test -v -p 1 -count=1 -timeout 30m $(FIPS_UNIT_PKGS) > $(BIN)/test-logs/fips-unit.log 2>&1; \
		unit=$$?; mid=$$(date +%s); \
	REKEY_TESTBED_FIPS=1 REKEY_TESTBED_GOFIPS140=$(FIPS_MODULE) $(GO) test -v -p 1 -count=1 -timeout 40m \
		-run '$(FIPS_E2E_RUN)' -skip '$(FIPS_E2E_SKIP)' ./test/e2e > $(BIN)/test-logs/fips-e2e.log 2>&1; \
		e2e=$$?; end=$$(date +%s); \
	for s in unit e2e; do l=$(BIN)/test-logs/fips-$$s.log; \
		grep -E '^(ok|FAIL|panic:)|^\s*--- FAIL' $$l; \
		echo "test-fips $$s: tests (subtests included) passed $$(grep -cE '^\s*--- PASS' $$l), failed $$(grep -cE '^\s*--- FAIL' $$l), skipped $$(grep -cE '^\s*--- SKIP' $$l); top-level passed $$(grep -cE '^--- PASS' $$l), skipped $$(grep -cE '^--- SKIP' $$l); log $$l"; \
	done; \
	echo "test-fips: unit exit $$unit in $$((mid-start)) s, e2e exit $$e2e in $$((end-mid)) s"; \
	test $$unit = 0 -a $$e2e = 0

## lint: gofmt, go vet, staticcheck, `go mod tidy` leaves no diff (here, in deploy/monitoring and in
## plugins/kms-pkcs11), the generated OpenAPI is current, README and DESIGN name every package.
lint: fmt vet staticcheck tidy-check openapi-check docs-check

docs-check:
	@bash hack/check-docs.sh

fmt:
	@bad=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$bad" ]; then echo "gofmt needed on:"; echo "$$bad"; exit 1; fi

vet:
	$(GO) vet ./...
	@# dist/kube-apiserver is a module of its own (k8s.io/kubernetes); REKEY_SKIP_KUBE_APISERVER=1 skips it.
	@if [ "$$REKEY_SKIP_KUBE_APISERVER" != 1 ]; then cd dist/kube-apiserver && $(GO) vet .; fi
	cd deploy/monitoring && $(GO) vet .
	cd plugins/kms-pkcs11 && $(GO) vet ./...

tools: $(STATICCHECK)

$(STATICCHECK):
	GOBIN=$(CURDIR)/$(dir $(STATICCHECK)) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

staticcheck: $(STATICCHECK)
	$(STATICCHECK) ./...
	cd deploy/monitoring && $(CURDIR)/$(STATICCHECK) .
	cd plugins/kms-pkcs11 && $(CURDIR)/$(STATICCHECK) ./...

# -diff prints what tidy would change and fails, leaving go.mod and go.sum untouched.
tidy-check:
	@$(GO) mod tidy -diff || { echo "go.mod/go.sum are not tidy: run go mod tidy and commit the result"; exit 1; }
	@cd deploy/monitoring && $(GO) mod tidy -diff || { echo "deploy/monitoring/go.mod/go.sum are not tidy: run go mod tidy there and commit the result"; exit 1; }
	@cd plugins/kms-pkcs11 && $(GO) mod tidy -diff || { echo "plugins/kms-pkcs11/go.mod/go.sum are not tidy: run go mod tidy there and commit the result"; exit 1; }

openapi-check:
	@bash hack/update-openapi.sh --verify

## run: start the local KMS v2 plugin and the apiserver shim with embedded etcd.
run:
	@bash hack/run.sh

## e2e: process-level tests (etcd, KMS v2 plugin and apiserver shim as real processes,
## kubectl and client-go); also part of `make test`. E2E_LONG=1 adds the long scenarios (make e2e-long).
e2e:
	$(GO) test -count=1 -v -timeout 45m ./test/e2e

## e2e-long: the long process-level scenarios (E2E_LONG=1): the ways the cluster fence
## could be fooled (parallel rotate runs, a second cluster, a leftover member record, a
## revert during a rotation, a KMS restart during a key-id hold), the etcd member outage
## scenario with its baseline rotation (the default run skips it) and the throughput run; then the
## PKCS#11 plugin's three-apiserver rotation scenario (plugins/kms-pkcs11).
e2e-long:
	E2E_LONG=1 $(GO) test -count=1 -v -timeout 60m -run 'ClusterFooled|ClusterOneEtcdMemberDown|Throughput' ./test/e2e
	@# plugins/kms-pkcs11: three shims, a PKCS#11 plugin each on one SoftHSM2 token, three rotations under writers.
	bash hack/softhsm.sh
	cd plugins/kms-pkcs11 && E2E_LONG=1 $(GO) test -count=1 -v -timeout 15m -run '^TestCluster' .

# What every bench target writes: BENCHMARKS.md (the notes, every scenario in
# docs/bench/results.json, then the hand-measured docs/bench/appendix.md), the results
# JSON and every chart. -merge keeps the scenarios a run does not measure.
BENCH_OUT := -notes docs/benchmark-notes.md -appendix docs/bench/appendix.md -merge docs/bench/results.json \
	-markdown BENCHMARKS.md -results docs/bench/results.json -charts docs/bench

## bench: the side-by-side harness (rekey vs upstream in one run); writes BENCHMARKS.md,
## the results as JSON (docs/bench/results.json) and every chart as SVG and PNG under
## docs/bench. BENCH_FLAGS=-short finishes in under 2 minutes. The rotation scenario is
## not part of it (bench-rotation); its earlier results are kept.
bench:
	$(GO) run ./cmd/rekey-bench $(BENCH_FLAGS) $(BENCH_OUT)

## bench-rotation: the rotation scenario alone (rekey rotate --wait vs
## upstream's procedure, 10,000 Secrets on 3 apiservers, 6–8 minutes); replaces its
## section of BENCHMARKS.md and results.json and keeps every other one.
bench-rotation:
	$(GO) run ./cmd/rekey-bench -scenarios rotation $(BENCH_FLAGS) $(BENCH_OUT)

## bench-controller: the controller scenario alone: a rotation declared on a
## ControlPlaneEncryption object (rekey controller, a management kube-apiserver with the
## CRD) vs a Gardener-style procedure (the same Secret edits, rolling restarts, a rewrite
## of every object), CONTROLLER_N Secrets (default 10,000), projection delays
## CONTROLLER_DELAYS (default 0s-60s). BENCH_FLAGS=-short: 300 Secrets, 0s-5s, under 2 minutes.
CONTROLLER_N ?=
CONTROLLER_DELAYS ?=
bench-controller:
	$(GO) run ./cmd/rekey-bench -scenarios controller $(if $(CONTROLLER_N),-controller-objects $(CONTROLLER_N)) $(if $(CONTROLLER_DELAYS),-controller-delays $(CONTROLLER_DELAYS)) $(BENCH_FLAGS) $(BENCH_OUT)

## bench-scale: the scale scenario alone: N Secrets of 1–10 KiB (SCALE_N, default
## 1,000,000) in an etcd process with a 2 GiB quota rotated on one apiserver under a
## client load, rekey's migration vs upstream's kubectl get | replace; replaces its
## section of BENCHMARKS.md and results.json and keeps every other one.
## BENCH_FLAGS=-short runs 20,000 Secrets in about 2 minutes.
bench-scale:
	REKEY_BENCH_SCALE_N=$(SCALE_N) $(GO) run ./cmd/rekey-bench -scenarios scale $(BENCH_FLAGS) $(BENCH_OUT)

## charts: draw every chart again (SVG and PNG) from docs/bench/results.json, measuring
## nothing; the README's headline chart is docs/bench/headline.png.
charts:
	$(GO) run ./cmd/rekey-bench -from docs/bench/results.json -charts docs/bench > /dev/null

## bench-go: the Go benchmarks (go test -bench), also side by side with upstream.
bench-go:
	$(GO) test -run '^$$' -bench . -benchmem -count $${COUNT:-5} ./pkg/...

## sim: the cluster's fence and leader machines under 10,000 random schedules of 100
## simulated apiservers (about 12 minutes on two cores); prints the convergence times.
sim:
	REKEY_SIM_FULL=1 $(GO) test -count=1 -timeout 3h -run TestClusterMachinesUnderRandomSchedules -v ./pkg/cluster/

## fuzz: every fuzz target for FUZZTIME each (default 20s).
fuzz:
	@bash hack/fuzz.sh

## kube-apiserver: bin/kube-apiserver, kube-apiserver $(KUBE_VERSION) with rekey as its encryption
## layer (dist/kube-apiserver); the first build compiles k8s.io/kubernetes (many minutes).
kube-apiserver:
	cd dist/kube-apiserver && $(GO) build -ldflags "$(KUBE_LDFLAGS)" -o $(abspath $(BIN))/kube-apiserver .

## run-kube-apiserver: etcd, the local KMS v2 plugin and bin/kube-apiserver, like `make run`.
run-kube-apiserver: kube-apiserver
	@bash hack/run-kube-apiserver.sh

## kms-pkcs11: bin/rekey-kms-pkcs11, the KMS v2 plugin on PKCS#11 (plugins/kms-pkcs11, a module of
## its own: it needs cgo and the PKCS#11 headers crypto11 carries; no library to link).
kms-pkcs11:
	cd plugins/kms-pkcs11 && CGO_ENABLED=1 $(GO) build -o $(abspath $(BIN))/rekey-kms-pkcs11 .

## upstream-mock-kms: bin/upstream-mock-kms-plugin, upstream's mock KMS v2 plugin on PKCS#11
## (k8s.io/kms/plugins/mock), built from upstream's own source at a pinned commit of
## github.com/kubernetes/kms (KMS_SRC: a local git directory of it instead of a clone; KMS_COMMIT)
## against the k8s.io/kms version of go.mod; none of its code is kept here.
upstream-mock-kms:
	bash hack/build-upstream-mock-kms.sh $(BIN)/upstream-mock-kms-plugin

## bench-kms-pkcs11-rotation: the same KMS v2 rotation of BENCH_SECRETS Secrets (default 2,000) on
## three shims, in one run: rekey-kms-pkcs11 (one process, `rotate`) and upstream's mock plugin
## (two processes, the two-plugin procedure through rekey rotate --wait --provider kms); the
## config files follow one source file after 0-BENCH_SYNC_DELAY (default 10s) each. Logs the
## table docs/bench/appendix.md keeps. Needs SoftHSM2 and OpenSC (hack/softhsm.sh).
BENCH_SECRETS ?= 2000
BENCH_SYNC_DELAY ?= 10s
bench-kms-pkcs11-rotation: upstream-mock-kms
	cd plugins/kms-pkcs11 && REKEY_BENCH_UPSTREAM_MOCK=1 REKEY_BENCH_SECRETS=$(BENCH_SECRETS) REKEY_BENCH_SYNC_DELAY=$(BENCH_SYNC_DELAY) \
		UPSTREAM_MOCK_KMS_PLUGIN=$(abspath $(BIN))/upstream-mock-kms-plugin \
		$(GO) test -p 1 -count=1 -v -timeout 30m -run '^TestRotationAgainstUpstreamMock$$' .

## test-kms-pkcs11: the plugin's tests alone (SoftHSM2 tokens in temporary directories; they fail,
## never skip, without softhsm2: apt-get install -y softhsm2 opensc).
test-kms-pkcs11:
	bash hack/softhsm.sh
	cd plugins/kms-pkcs11 && $(GO) test -count=1 -v -timeout 5m ./...

clean:
	rm -rf $(BIN)
