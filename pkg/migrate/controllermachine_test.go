package migrate

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// TestControllerTranscripts runs testdata/controller_*.txt: each file is a story told as
// commands (which key each resource is written with, what the next inventory or
// migration will report, how much time passes) and the controller machine's answers
// (what it asks the driver to do, and its status). No etcd, no ticker: the harness
// carries out the actions as Controller.check does, with scripted results.
// `go test -run TestControllerTranscripts -rewrite` rewrites the answers; read the diff
// before committing it.
//
// Commands:
//
//	reset [auto=true|false] [resources=secrets,configmaps]
//	                      a new machine at +0s (check interval 5s, inventory every 10m,
//	                      backoff 5s doubling to 5m); every resource written as plaintext
//	target <resource>=<target> ...
//	                      the write targets from now on: identity, aesgcm:<key> or
//	                      kms:<provider>[@<key id>] (no key id: not known yet)
//	inventory <resource>=<objects>/<stale> ...
//	                      what the next inventories find; unnamed resources are empty.
//	                      An input line is the error they fail with instead.
//	migration [transient] [rescan=<resource>:<objects>/<stale>,...]
//	                      how the next migrations end: an input line is their error
//	                      (transient: a KMS plugin failure), none is success; rescan is
//	                      what their verifying re-scan finds (none when not given)
//	check [+<duration>] [times=N]
//	                      moves the clock (N times) and runs one check each time,
//	                      printing every action the machine hands out and what it
//	                      finds, then the status
//	latest                prints the latest inventory the guard would judge with
//	ask                   the guard asks for a fresh inventory before the next check
//	elsewhere [<resource> ...]
//	                      the resources whose inventory another component takes now
//	                      (the cluster migrator rewriting them); none: no resource
//	adopt <resource>=<objects>/<stale> ...
//	                      another component stores an inventory of the resources under
//	                      their current targets, merged into the latest (the cluster
//	                      migrator adopting the leader's verifying re-scan)
func TestControllerTranscripts(t *testing.T) {
	datadriven.Walk(t, "testdata", func(t *testing.T, path string) {
		if !strings.HasPrefix(path[strings.LastIndex(path, "/")+1:], "controller_") {
			t.Skip("not a controller transcript")
		}
		h := newControllerHarness(true, []string{"secrets"})
		datadriven.RunTest(t, path, func(t *testing.T, d *datadriven.TestData) string {
			return h.run(t, d)
		})
	})
}

type controllerHarness struct {
	m         *controllerMachine
	asked     bool
	resources []Resource
	now       time.Time
	targets   map[string]writeTarget
	// scripted results
	invFound  map[string][2]int64
	invErr    error
	migErr    error
	migRescan map[string][2]int64
	// latest is the inventory store's content.
	latest *Inventory
	// elsewhere: the resources another component inventories now.
	elsewhere map[string]bool
	// revision is the etcd revision of the latest inventory taken (each reads at a
	// later one).
	revision int64
}

func newControllerHarness(auto bool, names []string) *controllerHarness {
	h := &controllerHarness{now: t0, targets: map[string]writeTarget{}, invFound: map[string][2]int64{}}
	for _, n := range names {
		h.resources = append(h.resources, ResourceFor(DefaultEtcdPrefix, schema.ParseGroupResource(n)))
		h.targets[n] = writeTarget{}
	}
	h.m = newControllerMachine(machineConfig{resources: h.resources, autoMigrate: auto, inventoryInterval: defaultInventoryInterval,
		retryBackoff: defaultRetryBackoff, maxRetryBackoff: defaultMaxRetryBackoff})
	return h
}

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func (h *controllerHarness) run(t *testing.T, d *datadriven.TestData) string {
	switch d.Cmd {
	case "reset":
		auto, names := true, "secrets"
		d.MaybeScanArgs(t, "auto", &auto)
		d.MaybeScanArgs(t, "resources", &names)
		*h = *newControllerHarness(auto, strings.Split(names, ","))
		return "ok"
	case "target":
		for _, a := range d.CmdArgs {
			if _, ok := h.targets[a.Key]; !ok || len(a.Vals) != 1 {
				d.Fatalf(t, "target %s: name a resource of the reset and one target", a.Key)
			}
			h.targets[a.Key] = parseTarget(t, d, a.Vals[0])
		}
		return "ok"
	case "inventory":
		h.invErr, h.invFound = nil, map[string][2]int64{}
		if in := strings.TrimSpace(d.Input); in != "" {
			h.invErr = errors.New(in)
		}
		for _, a := range d.CmdArgs {
			h.invFound[a.Key] = parseCounts(t, d, a.Vals)
		}
		return "ok"
	case "migration":
		h.migErr, h.migRescan = nil, nil
		if msg := strings.TrimSpace(d.Input); msg != "" {
			h.migErr = errors.New(msg)
			if d.HasArg("transient") {
				h.migErr = transient([]byte("/registry/secrets/ns/obj-0042"), h.migErr)
			}
		}
		for _, a := range d.CmdArgs {
			if a.Key != "rescan" {
				continue
			}
			h.migRescan = map[string][2]int64{}
			for _, v := range a.Vals {
				for _, one := range strings.Split(v, ",") {
					name, counts, _ := strings.Cut(strings.TrimSpace(one), ":")
					h.migRescan[name] = parseCounts(t, d, []string{counts})
				}
			}
		}
		return "ok"
	case "check":
		step := time.Duration(0)
		if len(d.CmdArgs) > 0 && strings.HasPrefix(d.CmdArgs[0].Key, "+") {
			var err error
			if step, err = time.ParseDuration(d.CmdArgs[0].Key[1:]); err != nil {
				d.Fatalf(t, "%v", err)
			}
		}
		times := 1
		d.MaybeScanArgs(t, "times", &times)
		var b strings.Builder
		for i := 0; i < times; i++ {
			h.now = h.now.Add(step)
			h.check(&b)
		}
		v := h.m.View()
		fmt.Fprintf(&b, "status: failures=%d", v.ConsecutiveFailures)
		if !v.RetryAt.IsZero() {
			fmt.Fprintf(&b, " retry-at=%s", h.rel(v.RetryAt))
		}
		if v.LastError != "" {
			fmt.Fprintf(&b, " last-error=%q", v.LastError)
		}
		return b.String()
	case "latest":
		return h.describe(h.latest)
	case "ask":
		h.asked = true
		return "ok"
	case "elsewhere":
		h.elsewhere = map[string]bool{}
		for _, a := range d.CmdArgs {
			h.elsewhere[a.Key] = true
		}
		return "ok"
	case "adopt":
		found := map[string][2]int64{}
		var rs []Resource
		for _, a := range d.CmdArgs {
			found[a.Key] = parseCounts(t, d, a.Vals)
			rs = append(rs, ResourceFor(DefaultEtcdPrefix, schema.ParseGroupResource(a.Key)))
		}
		h.latest = mergeInventories(h.latest, h.inventory(found, rs), h.resources)
		return h.describe(h.latest)
	}
	d.Fatalf(t, "unknown command %s", d.Cmd)
	return ""
}

// check is Controller.check with scripted inventories and migrations.
func (h *controllerHarness) check(b *strings.Builder) {
	h.m.Step(checkEvent{now: h.now, targets: h.copyTargets(), freshAsked: h.asked, elsewhere: h.elsewhere, stored: storedInventories(h.latest)})
	h.asked = false
	for acts := h.m.Ready(); len(acts) > 0; acts = h.m.Ready() {
		for _, a := range acts {
			switch a.kind {
			case actTakeInventory:
				if h.invErr != nil {
					fmt.Fprintf(b, "%s: take inventory: %v\n", h.rel(h.now), h.invErr)
					h.m.Step(inventoryEvent{now: h.now, err: h.invErr})
					continue
				}
				inv := h.inventory(h.invFound, h.resources)
				fmt.Fprintf(b, "%s: take inventory: %s\n", h.rel(h.now), h.describe(inv))
				h.m.Step(inventoryEvent{now: h.now, inv: inv})
			case actRecordInventory:
				inv := a.inventory
				if a.merge {
					inv = mergeInventories(h.latest, inv, h.resources)
				}
				h.latest = inv
				what := "record inventory"
				if a.merge {
					what = "merge re-scan into the latest inventory"
				}
				fmt.Fprintf(b, "%s: %s\n", h.rel(h.now), what)
			case actMigrate:
				var parts []string
				for _, r := range a.resources {
					parts = append(parts, r.String()+" to "+a.targets[r.String()].String())
				}
				fmt.Fprintf(b, "%s: migrate %s →", h.rel(h.now), strings.Join(parts, ", "))
				var verified *Inventory
				if h.migRescan != nil {
					verified = h.inventory(h.migRescan, a.resources)
				}
				if h.migErr != nil {
					fmt.Fprintf(b, " failed: %v\n", h.migErr)
				} else {
					fmt.Fprintf(b, " done\n")
				}
				h.m.Step(migrationEvent{now: h.now, verified: verified, err: h.migErr})
			}
		}
	}
}

func (h *controllerHarness) copyTargets() map[string]writeTarget {
	out := make(map[string]writeTarget, len(h.targets))
	for k, v := range h.targets {
		out[k] = v
	}
	return out
}

// inventory is what a scan of resources finds: found[name] = objects, stale.
func (h *controllerHarness) inventory(found map[string][2]int64, resources []Resource) *Inventory {
	inv := &Inventory{TakenAt: h.now, DecryptChecked: true}
	h.revision++
	for _, r := range resources {
		c := found[r.String()]
		t := h.targets[r.String()]
		inv.Resources = append(inv.Resources, ResourceInventory{Resource: r.String(), KeyPrefix: r.KeyPrefix,
			WritePrefix: t.Prefix, WriteKeyIDHash: t.KeyIDHash, Objects: c[0], Stale: c[1], Revision: h.revision})
	}
	return inv
}

func (h *controllerHarness) describe(inv *Inventory) string {
	if inv == nil {
		return "none"
	}
	var parts []string
	for _, ri := range inv.Resources {
		parts = append(parts, fmt.Sprintf("%s=%d/%d (at %s)", ri.Resource, ri.Objects, ri.Stale, writeTarget{Prefix: ri.WritePrefix, KeyIDHash: ri.WriteKeyIDHash}))
	}
	sort.Strings(parts)
	return strings.Join(parts, " ") + " taken " + h.rel(inv.TakenAt)
}

func (h *controllerHarness) rel(at time.Time) string { return "+" + at.Sub(t0).String() }

// parseTarget reads identity, aesgcm:<key> or kms:<provider>[@<key id>].
func parseTarget(t *testing.T, d *datadriven.TestData, s string) writeTarget {
	provider, rest, _ := strings.Cut(s, ":")
	switch provider {
	case "identity":
		return writeTarget{}
	case "aesgcm":
		return writeTarget{Prefix: transformers.KeyPrefix(transformers.AESGCMPrefix, rest)}
	case "kms":
		name, keyID, known := strings.Cut(rest, "@")
		wt := writeTarget{Prefix: transformers.KeyPrefix(transformers.KMSv2Prefix, name)}
		if known {
			wt.KeyIDHash = "sha256:" + keyID
		}
		return wt
	}
	d.Fatalf(t, "target %q: want identity, aesgcm:<key> or kms:<provider>[@<key id>]", s)
	return writeTarget{}
}

// parseCounts reads "<objects>/<stale>".
func parseCounts(t *testing.T, d *datadriven.TestData, vals []string) [2]int64 {
	if len(vals) != 1 {
		d.Fatalf(t, "want <objects>/<stale>")
	}
	o, s, _ := strings.Cut(vals[0], "/")
	objects, err1 := strconv.ParseInt(o, 10, 64)
	stale, err2 := strconv.ParseInt(s, 10, 64)
	if err1 != nil || err2 != nil {
		d.Fatalf(t, "%q: want <objects>/<stale>", vals[0])
	}
	return [2]int64{objects, stale}
}
