package bench

import (
	"fmt"
	"slices"
	"sort"
)

// Scenario produces rows for one part of the harness.
type Scenario struct {
	Name string
	Desc string
	Run  func(s Settings) ([]Row, error)
	// Explicit scenarios take minutes: they run only when named (-scenarios), never
	// as part of the default run.
	Explicit bool
}

// Scenarios lists every scenario the harness knows, in run order.
func Scenarios() []Scenario {
	return []Scenario{
		{Name: "transform", Desc: "every local provider × payload size × serial/parallel × write/read; rekey vs upstream vs raw AES-256-GCM; allocations and retained heap", Run: runTransform},
		{Name: "kms", Desc: "KMS v2 writes and warm reads, gRPC round trips, a cold DEK-cache read storm and retained heap, against an in-process plugin on a unix socket", Run: runKMS},
		{Name: "reload", Desc: "time from a config rename to the first write using it: rekey's agent (local and new KMS v2 provider) vs upstream's 1-minute-poll controller (skipped in short mode)", Run: runReload},
		{Name: "migrate", Desc: "storage migration against an etcd process: objects/s re-encrypted (aesgcm key change, aesgcm ↔ KMS v2), inventory time, peak heap", Run: runMigrate},
		{Name: "e2e", Desc: "the apiserver shim on embedded etcd, Secrets with KMS v2: create+get throughput and latency, rekey's layer vs the same shim with upstream's layer", Run: runE2E},
		{Name: "kube-apiserver", Desc: "bin/kube-apiserver (dist/kube-apiserver) on an etcd process, Secrets with KMS v2: the e2e load against rekey's layer and upstream's (--encryption-layer) in the same binary; time to ready, RSS (skipped in short mode)", Run: runKubeAPIServer},
		{Name: "rotation", Desc: "local-key rotation of 10,000 Secrets on 3 apiservers (3-member etcd, kubelet-like file delays, writers and a sampler): `rekey rotate --wait` vs upstream's documented procedure on the same testbed with --encryption-layer=upstream; takes 6–8 minutes, runs only when named", Run: runRotation, Explicit: true},
		{Name: "controller", Desc: "a key rotation declared on a ControlPlaneEncryption object (`rekey controller`, a management kube-apiserver with the CRD) of N Secrets (default 10,000; short 300) on 3 hosted apiservers whose configuration Secret is projected into each one after a random seeded delay (default 0–60 s; short 0–5 s), with writers and a sampler, against a Gardener-style procedure on the same testbed with --encryption-layer=upstream: the same Secret edits, a rolling restart of the apiservers after each, a rewrite of every object through the API; time, restarts, failed requests, unreadable reads, client p50/p99; runs only when named", Run: runController, Explicit: true},
		{Name: "scale", Desc: "local-key rotation of N Secrets of 1–10 KiB (default 1,000,000; short 20,000) in an etcd process with a 2 GiB quota (-scale-quota-bytes), on one apiserver under a steady client load (none with -scale-idle): rekey's storage migration vs `kubectl get secrets -A -o json | kubectl replace -f -` with --encryption-layer=upstream; inventory time, objects/s, etcd DB peak and NOSPACE alarms, client p50/p99 baseline vs during, the apiserver's peak RSS; runs only when named", Run: runScale, Explicit: true},
	}
}

// Select returns the named scenarios, or an error naming the unknown one.
func Select(names []string) ([]Scenario, error) {
	all := Scenarios()
	if len(names) == 0 {
		var def []Scenario
		for _, s := range all {
			if !s.Explicit {
				def = append(def, s)
			}
		}
		return def, nil
	}
	byName := map[string]Scenario{}
	var known []string
	for _, s := range all {
		byName[s.Name] = s
		known = append(known, s.Name)
	}
	sort.Strings(known)
	var out []Scenario
	for _, n := range names {
		s, ok := byName[n]
		if !ok {
			return nil, fmt.Errorf("unknown scenario %q (known: %v)", n, known)
		}
		out = append(out, s)
	}
	return out, nil
}

// checkSides refuses a side of scenario that is not one of known (-<scenario>-sides).
func checkSides(scenario string, sides, known []string) error {
	for _, side := range sides {
		if !slices.Contains(known, side) {
			return fmt.Errorf("%s side %q: must be one of %v", scenario, side, known)
		}
	}
	return nil
}

// sidesRow is a row of a scenario whose sides each ran once: one whole-run figure per
// side (named by impls, in the order of sides), value of its result, "not run" for a
// side without one.
func sidesRow[R any](scenario, c, unit string, sides, impls []string, res map[string]*R, value func(*R) float64) Row {
	r := Row{Scenario: scenario, Case: c}
	for i, side := range sides {
		v := 0.0
		if res[side] != nil {
			v = value(res[side])
		}
		f := wholeRunFigure(impls[i], unit, single(v), false)
		if res[side] == nil {
			f.Note = "not run"
		}
		r.Figures = append(r.Figures, f)
	}
	return r
}
