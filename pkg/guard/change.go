package guard

import (
	"fmt"
	"sort"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Violation is one set of stored objects a configuration change would leave unreadable.
type Violation struct {
	Resource string
	Bucket   migrate.Bucket
	// Objects is the count from the inventory; -1 when it is not known.
	Objects int64
	// Reason says why the objects are (or may be) there.
	Reason string
}

func (v Violation) String() string {
	what := v.Bucket.Describe()
	if v.Bucket.Prefix != "" {
		what += fmt.Sprintf(" (prefix %q)", v.Bucket.Prefix)
	}
	if v.Objects >= 0 {
		return fmt.Sprintf("%s: %d objects are stored under %s, %s", v.Resource, v.Objects, what, v.Reason)
	}
	return fmt.Sprintf("%s: %s %s", v.Resource, what, v.Reason)
}

// CheckChange lists what replacing current with next would make unreadable:
//
//   - every (resource, provider, key) bucket of inv with objects > 0 that current can
//     read and next cannot (a local key also counts as dropped when next has a key of
//     the same name with a different secret; a KMS v2 provider counts as kept while
//     next has a KMS v2 provider of the same name, since the plugin's own keyring
//     cannot be seen from here — NewDecrypt proves it with a stored DEK);
//   - for every resource whose lookup chain may change, its write key under current,
//     when next cannot read it: values may have been written with it since any
//     inventory;
//   - for every such resource inv does not cover, or whose write key changed since inv
//     was taken (the inventory no longer describes what was written since), every key
//     of current that next cannot read, with an unknown count.
//
// The resources judged are the union of those named by current's rules, by next's
// rules and by inv: a new, more specific rule in next (an exact name, or a group
// wildcard such as *.apps shadowing *.*) changes what its resources resolve to even
// though current never names them. Wildcard rules are judged as pseudo-resources
// ("*.apps", "*.*"): they stand for every resource of the group they match, which no
// inventory can list.
//
// inv may be nil (no inventory yet): then every dropped key is reported.
func CheckChange(inv *migrate.Inventory, current, next *config.Config) []Violation {
	return CheckReload(inv, current, next, nil)
}

// CheckReload is CheckChange for a running apiserver whose write fence may have chosen
// another writer than the configuration's first entry: running is its Set's rules
// (Set.Rules, reload.Agent.Rules) for current. A key the fence holds back has written
// nothing, so dropping it is no more a drop of "the key this resource is written with
// now" than dropping any other read key; a rule whose writes the fence refuses writes
// with no key. nil running means the configuration's first entry writes.
func CheckReload(inv *migrate.Inventory, current, next *config.Config, running []transformers.RuleInfo) []Violation {
	return checkChains(inv, newChains(current).withWriters(running), newChains(next), false)
}

// checkChains is CheckChange on the read capabilities of two configurations. fresh
// says inv was taken just now with nothing written since (at start, before serving): its
// counts then describe every resource it covers, whatever write key it was taken under.
func checkChains(inv *migrate.Inventory, cur, nxt chains, fresh bool) []Violation {
	var out []Violation
	covered := map[schema.GroupResource]bool{}
	seen := map[string]bool{}
	add := func(v Violation) {
		k := v.Resource + "\x00" + v.Bucket.Prefix + "\x00" + v.Bucket.KeyIDHash
		if !seen[k] {
			seen[k] = true
			out = append(out, v)
		}
	}
	if inv != nil {
		// A wildcard rule is covered when the inventory scanned every resource it
		// matched (the whole key space) and none of them is outdated.
		wildcardOutdated := map[schema.GroupResource]bool{}
		for _, ri := range inv.Resources {
			gr := schema.ParseGroupResource(ri.Resource)
			cc, nc := cur.lookup(gr), nxt.lookup(gr)
			rule, _, _ := transformers.LookupRule(cur.byGR, gr)
			// A rule whose writes are refused adds no object under any key, so an
			// inventory of it stays as current as when it was taken.
			if wp, ok := cc.writePrefix(); !fresh && ok && wp != ri.WritePrefix {
				wildcardOutdated[rule] = true
				continue // outdated for this resource; handled as not covered below
			}
			// No object at a guessed location proves nothing: the objects found there
			// count, but the resource stays uncovered.
			if !ri.Guessed {
				covered[gr] = true
			}
			for _, b := range ri.Buckets {
				if b.Objects == 0 || !cc.canRead(b.Prefix) || nc.canReadAll(b.Prefix, cc) || b.AllAcknowledged() {
					// A bucket of acknowledged unreadable objects only: an operator
					// accepted that nothing reads them, with or without the key.
					continue
				}
				reason := fmt.Sprintf("per the inventory taken at %s", inv.TakenAt.UTC().Format("2006-01-02T15:04:05Z"))
				add(Violation{Resource: ri.Resource, Bucket: b.Bucket, Objects: b.Objects, Reason: reason + unreadableNote(ri.Resource, b)})
			}
		}
		for _, w := range inv.Wildcards {
			if gr := schema.ParseGroupResource(w); !wildcardOutdated[gr] {
				covered[gr] = true
			}
		}
		// The scan behind a covered wildcard saw the whole key space: a resource it
		// found at a guessed location has no objects anywhere else.
		for _, ri := range inv.Resources {
			gr := schema.ParseGroupResource(ri.Resource)
			if rule, _, ok := transformers.LookupRule(cur.byGR, gr); ok && rule != gr && covered[rule] {
				covered[gr] = true
			}
		}
	}
	// Resources to judge without counts: every rule of current and of next (wildcards
	// as themselves) plus every resource the inventory covers.
	var grs []schema.GroupResource
	judged := map[schema.GroupResource]bool{}
	judge := func(gr schema.GroupResource) {
		if !judged[gr] {
			judged[gr] = true
			grs = append(grs, gr)
		}
	}
	for _, gr := range cur.order {
		judge(gr)
	}
	for _, gr := range nxt.order {
		judge(gr)
	}
	if inv != nil {
		for _, ri := range inv.Resources {
			judge(schema.ParseGroupResource(ri.Resource))
		}
	}
	for _, gr := range grs {
		cc, nc := cur.lookup(gr), nxt.lookup(gr)
		name := config.GroupResourceString(gr)
		if covered[gr] && fresh {
			continue // the counts above are exact: nothing was written since
		}
		if wp, ok := cc.writePrefix(); ok && !nc.canReadAll(wp, cc) {
			add(Violation{Resource: name, Bucket: bucketOf(wp), Objects: -1, Reason: "is the key this resource is written with now, so objects written since the last inventory use it; make the new key the write key first and keep this one as a read key"})
		}
		if covered[gr] {
			continue
		}
		for _, e := range cc.entries {
			if !nc.canReadAll(e.prefix, cc) {
				add(Violation{Resource: name, Bucket: bucketOf(e.prefix), Objects: -1, Reason: uncoveredReason(gr, inv)})
			}
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Resource < out[j].Resource })
	return out
}

// uncoveredReason says why a resource's keys may still hold objects, and what to do.
func uncoveredReason(gr schema.GroupResource, inv *migrate.Inventory) string {
	if inv != nil {
		if ri := inv.Find(config.GroupResourceString(gr)); ri != nil && ri.Guessed {
			return fmt.Sprintf("may still hold objects: the inventory found none at %s, but nothing says this resource is stored there (no CustomResourceDefinition for it is stored, and it is no kube-apiserver resource); name its etcd path (--resources %s=/path/) and retry", ri.KeyPrefix, config.GroupResourceString(gr))
		}
	}
	return "may still hold objects: no current inventory covers this resource; run `rekey inventory` (or let the apiserver take one) and retry"
}

// unreadableNote tells, for a bucket holding unreadable objects, how many are
// acknowledged and how to acknowledge the rest; "" when it holds none.
func unreadableNote(resource string, b migrate.Count) string {
	if b.Unreadable == 0 && b.Acknowledged == 0 {
		return ""
	}
	note := fmt.Sprintf("; %d of them are acknowledged unreadable objects", b.Acknowledged)
	if rest := b.Unreadable - b.Acknowledged; rest > 0 {
		note += fmt.Sprintf(" and %d more are unreadable: if they may stay so, acknowledge them (rekey inventory lists them) with `rekey migrate --acknowledge-unreadable %s/<namespace>/<name>[,...] --reason \"...\"`", rest, resource)
	}
	if readable := b.Objects - b.Unreadable; readable > 0 {
		note += fmt.Sprintf("; %d are readable and need a migration to the new key first", readable)
	}
	return note
}

func bucketOf(prefix string) migrate.Bucket {
	p, k := transformers.SplitPrefix(prefix)
	return migrate.Bucket{Provider: p, Key: k, Prefix: prefix, KnownKey: true}
}

// New returns a reload guard (reload.Options.Guard) backed by the latest inventory in
// store. A change that CheckChange objects to is refused with a *RefusedError (Check
// Change), unless override returns true (then it is logged and allowed), and counted in
// m (which may be nil).
func New(store *migrate.InventoryStore, override func() bool, running func() []transformers.RuleInfo, m *Metrics, logger klog.Logger) func(current, next *config.Config) error {
	if logger.GetSink() == nil {
		logger = klog.Background()
	}
	return func(current, next *config.Config) error {
		var rules []transformers.RuleInfo
		if running != nil {
			rules = running()
		}
		vs := CheckReload(store.Latest(), current, next, rules)
		if len(vs) == 0 {
			return nil
		}
		// The refusal rests on the latest inventory: ask for a fresh one, so that a
		// change retried after the data moved is judged on what is stored then, not
		// for the whole inventory interval on counts taken before.
		store.AskFresh()
		gerr := &RefusedError{Check: Change, Next: ConfigName(next), Violations: vs}
		if override != nil && override() {
			logger.Info("Allowing a configuration change that drops keys still in use, because the override is set", "config", next.Source, "hash", next.Hash, "violations", len(vs), "detail", gerr.Error())
			return nil
		}
		return m.Count(gerr)
	}
}

// ---- the read capabilities of a configuration, without building it ----

type chainEntry struct {
	prefix string
	// fp fingerprints a local key's secret (transformers.KeyFingerprint); zero for
	// identity and KMS.
	fp [32]byte
}

// chain is one resource's read path; writer is the index of the entry that writes (0
// unless a write fence chose another; transformers.NoWriter when it refuses writes).
type chain struct {
	entries []chainEntry
	writer  int
}

// writePrefix is the prefix new values get; ok is false when nothing writes.
func (c chain) writePrefix() (prefix string, ok bool) {
	if c.writer < 0 || c.writer >= len(c.entries) {
		return "", false
	}
	return c.entries[c.writer].prefix, true
}

func (c chain) canRead(prefix string) bool {
	for _, e := range c.entries {
		if e.prefix == prefix {
			return true
		}
	}
	return false
}

// canReadAll reports whether c reads prefix with every secret that from reads it with.
func (c chain) canReadAll(prefix string, from chain) bool {
	if !c.canRead(prefix) {
		return false
	}
	for _, fe := range from.entries {
		if fe.prefix != prefix {
			continue
		}
		found := false
		for _, e := range c.entries {
			if e.prefix == prefix && e.fp == fe.fp {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

type chains struct {
	byGR  map[schema.GroupResource]chain
	order []schema.GroupResource
}

var identityChain = chain{entries: []chainEntry{{prefix: ""}}}

// newChains is the guard's view of cfg: the same per-entry description the applied
// state persists, joined per resource as a Set joins them.
func newChains(cfg *config.Config) chains { return chainsOf(appliedRules(cfg)) }

// withWriters sets each chain's writer from a running Set's rules of the same
// configuration (a rule whose read path differs is left as configured).
func (cs chains) withWriters(running []transformers.RuleInfo) chains {
	for _, r := range running {
		gr := schema.ParseGroupResource(r.Resource)
		c, ok := cs.byGR[gr]
		if !ok || len(c.entries) != len(r.ReadPrefixes) {
			continue
		}
		same := true
		for i, e := range c.entries {
			same = same && e.prefix == r.ReadPrefixes[i]
		}
		if same {
			c.writer = r.WriteIndex
			cs.byGR[gr] = c
		}
	}
	return cs
}

func (cs chains) lookup(gr schema.GroupResource) chain {
	if c, ok := transformers.Lookup(cs.byGR, gr); ok {
		return c
	}
	return identityChain
}
