package cluster

import (
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	"k8s.io/apiserver/pkg/server/healthz"

	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// ReadyzCheckName is the /readyz check of a Node: /readyz/rekey-cluster.
const ReadyzCheckName = "rekey-cluster"

// ReadyzCheck fails, naming the missing keys, while this apiserver's configuration
// cannot read a key the cluster uses: one another live member writes with, or one the
// latest inventory counts stored objects under and another live member can read. Load balancers then stop sending the
// straggler traffic it would answer with errors. It belongs on /readyz only: a
// straggler is healthy, it just must not serve yet.
func (n *Node) ReadyzCheck() healthz.HealthChecker {
	return healthz.NamedCheck(ReadyzCheckName, func(*http.Request) error {
		n.mu.Lock()
		agent := n.agent
		n.mu.Unlock()
		if agent == nil {
			return fmt.Errorf("the encryption agent has not started")
		}
		// Fail closed until this apiserver knows enough to judge: without the member
		// list nothing says which keys the others write, and without an inventory
		// nothing says which keys the stored objects need (a straggler restarted with
		// an old file would look ready until its first inventory).
		if !n.view.Loaded() {
			return fmt.Errorf("the list of live apiservers under %s has not been loaded yet; check the connection to etcd", membersPrefix(n.opts.Prefix))
		}
		if err := n.publishFailure(); err != nil {
			return err
		}
		if err := n.clusterViewFailure(); err != nil { // a stale view, or writes held to resynchronise
			return err
		}
		if n.opts.Inventory != nil && n.opts.Inventory.Latest() == nil {
			return fmt.Errorf("no inventory of the stored objects yet, so it is not known whether this apiserver's encryption configuration can read them; waiting for the first one")
		}
		if held := firstSeedHolds(agent.OwnStatus().KMSProviders); len(held) > 0 {
			return fmt.Errorf("KMS v2 providers hold writes under their first key id until every apiserver's plugin reports it: %s", strings.Join(held, "; "))
		}
		if missing := n.MissingKeys(); len(missing) > 0 {
			return fmt.Errorf("this apiserver's encryption configuration cannot read keys the cluster uses: %s; add them to its configuration (as read keys)", strings.Join(missing, "; "))
		}
		return nil
	})
}

// MissingKeys lists what ReadyzCheck reports: the keys other live members write with
// that this apiserver's configuration cannot read (a KMS key id its plugin does not
// decrypt counts), keys this apiserver has under the name of another member's key with
// another secret where a live member writes with that name (splitConflicts; the others
// are ReadinessWarnings), and keys the latest inventory counts stored objects under that
// another live member can read. The write keys of stragglers (see stragglers) never
// count: a member that lags must not take the others out of service.
func (n *Node) MissingKeys() []string {
	var inv *migrate.Inventory
	if n.opts.Inventory != nil {
		inv = n.opts.Inventory.Latest()
	}
	return missingKeys(n.state(time.Time{}), n.view.Members(), inv)
}

// missingKeys is MissingKeys for this apiserver's state own, the live members (own may
// be among them, as published; own counts as it is now) and the latest inventory (nil
// when none).
func missingKeys(own MemberState, members []MemberState, inv *migrate.Inventory) []string {
	var missing []string
	add := func(s string) {
		if !slices.Contains(missing, s) {
			missing = append(missing, s)
		}
	}
	var others []MemberState
	for _, m := range members {
		if m.APIServerID != own.APIServerID {
			others = append(others, m)
		}
	}
	all := append(slices.Clone(others), own)
	written, _ := splitConflicts(all)
	for _, c := range written {
		if c.involves(own.APIServerID) {
			add(c.String() + " (the same name with different secrets: neither can read what the other writes; give every apiserver the same key)")
		}
	}
	straggling := map[string]map[string]bool{}
	stragglersOf := func(resource string) map[string]bool {
		if s, ok := straggling[resource]; ok {
			return s
		}
		straggling[resource] = stragglers(all, resource)
		return straggling[resource]
	}
	for _, m := range others {
		for _, r := range m.Resources {
			if r.Write.Provider == "" || stragglersOf(r.Resource)[m.APIServerID] {
				continue
			}
			if r.Write.Provider == transformers.ProviderKMSv2 && !keyIDCounts(all, m, r.Write) {
				continue
			}
			switch own.Reads(r.Resource, r.Write) {
			case transformers.KeysDiffer:
				if r.Write.Provider == transformers.ProviderKMSv2 && own.mayRead(r.Resource, Key{Provider: r.Write.Provider, Key: r.Write.Key}) {
					add(fmt.Sprintf("%s: %s (written by %s; this apiserver's KMS plugin does not report that key id)", r.Resource, r.Write, m.APIServerID))
					continue
				}
				add(fmt.Sprintf("%s: %s (written by %s)", r.Resource, r.Write, m.APIServerID))
			case transformers.KeysConflict:
				add(fmt.Sprintf("%s: %s (written by %s with another secret)", r.Resource, r.Write, m.APIServerID))
			}
		}
	}
	if inv == nil {
		return missing
	}
	for _, ri := range inv.Resources {
		for _, c := range ri.Buckets {
			k := Key{Provider: c.Provider, Key: c.Key}
			if c.Objects == 0 || c.Provider == transformers.ProviderUnknown || own.mayRead(ri.Resource, k) {
				continue
			}
			// Only a key another live member reads is one the cluster uses: data
			// nobody can read is lost, and failing every apiserver's readiness for it
			// would take the whole control plane down. A straggler's keys do not count
			// either.
			if by := readBy(others, stragglersOf(ri.Resource), ri.Resource, k); by != "" {
				add(fmt.Sprintf("%s: %s (%d stored objects, readable by %s)", ri.Resource, k, c.Objects, by))
			}
		}
	}
	return missing
}

// ReadinessWarnings lists what readiness deliberately lets pass (readinessWarnings):
// entries that no live member writes with, present on this apiserver with a check
// value another live member's differs from. The status document shows them.
func (n *Node) ReadinessWarnings() []string {
	return readinessWarnings(n.state(time.Time{}), n.view.Members())
}

// readinessWarnings is ReadinessWarnings for this apiserver's state own (as it is now)
// and the live members (own may be among them, as published).
func readinessWarnings(own MemberState, members []MemberState) []string {
	all := append(slices.DeleteFunc(slices.Clone(members), func(m MemberState) bool { return m.APIServerID == own.APIServerID }), own)
	_, readOnly := splitConflicts(all)
	var out []string
	for _, c := range readOnly {
		if c.involves(own.APIServerID) {
			out = append(out, c.readOnlyWarning())
		}
	}
	return out
}

// splitConflicts separates the key conflicts among members (keyConflicts) into those
// of entries a live member writes with, which fail the readiness of every member
// involved, and those of read-only entries, which are warnings.
//
// Why a read-only entry's conflict must not fail readiness: nothing new is written with
// it, so the members agree on every value written from now on; at worst some values
// stored under it long ago are unreadable on the members with the other check value,
// which failing readiness would not fix. And a KMS v1 entry is always read-only while
// its check value is that of its endpoint: rolling a socket path node by node makes
// the members differ for the whole roll, with one plugin key behind both paths —
// failing every apiserver's readiness for that would take the control plane down.
// Promotion and the guards still compare strictly (KeyInfo.Match): only readiness,
// the verdict and the alarm relax.
func splitConflicts(members []MemberState) (written, readOnly []Conflict) {
	for _, c := range keyConflicts(members) {
		if writesWith(members, c.Key) {
			written = append(written, c)
		} else {
			readOnly = append(readOnly, c)
		}
	}
	return written, readOnly
}

// writesWith reports whether some live member writes with the provider entry k (its
// provider and name, whatever its check value) for any resource: as its write entry
// now, as the key its fence holds back, or as the first entry of a chain (the
// configured write key, which a fence may promote at any moment). Any resource, not
// only the conflict's: a name that writes anywhere is not left to a warning. A KMS v1
// entry never writes: upstream forbids it in the write position and its Seal fails.
func writesWith(members []MemberState, k Key) bool {
	if k.Provider == transformers.ProviderKMSv1 {
		return false
	}
	for _, m := range members {
		for _, r := range m.Resources {
			if r.Write.SameEntry(k) || r.Held != nil && r.Held.SameEntry(k) || len(r.Read) > 0 && r.Read[0].SameEntry(k) {
				return true
			}
		}
	}
	return false
}

// readOnlyWarning is the warning of a conflict of a read-only entry: "secrets:
// kmsv1/old has 2 endpoints: check … on a; check … on b,c (read only, …)".
func (c Conflict) readOnlyWarning() string {
	checks := slices.Sorted(maps.Keys(c.Members))
	parts := make([]string, 0, len(checks))
	for _, check := range checks {
		parts = append(parts, fmt.Sprintf("check %s on %s", check, strings.Join(c.Members[check], ",")))
	}
	// A KMS v1 check value is that of its name and endpoint (it has no key id), so
	// what differs is the endpoint, and two endpoints may well reach one plugin key.
	what, fix := "secrets", "values stored under it are unreadable where the secret differs: give every apiserver the same secret"
	if c.Key.Provider == transformers.ProviderKMSv1 {
		what, fix = "endpoints", "make sure every endpoint reaches a plugin with the same key"
	}
	return fmt.Sprintf("%s: %s has %d %s: %s (read only, so readiness does not depend on it; %s)",
		c.Resource, c.Key, len(checks), what, strings.Join(parts, "; "), fix)
}

// readBy names the first member, stragglers left out, that may read k for resource
// ("" if none).
func readBy(members []MemberState, stragglers map[string]bool, resource string, k Key) string {
	for _, m := range members {
		if !stragglers[m.APIServerID] && m.mayRead(resource, k) {
			return m.APIServerID
		}
	}
	return ""
}

// firstSeedHolds names the KMS providers holding writes under their first DEK seed
// (kmsv2.FactoryOptions.FirstSeedHold): the apiserver is not ready while one does.
func firstSeedHolds(kms []transformers.KMSStatus) []string {
	var held []string
	for _, k := range kms {
		if !k.FirstSeedHeldUntil.IsZero() {
			held = append(held, fmt.Sprintf("%s (key id hash %s, at the latest until %s)", k.Name, k.KeyIDHash, k.FirstSeedHeldUntil.UTC().Format(time.RFC3339)))
		}
	}
	return held
}

// keyIDCounts reports whether m's KMS write key k (provider name and key id hash) is
// one other members must decrypt to be ready. It is not when m's plugin reports another
// key id (m writes under an older one while its fence holds the new one back: by the
// KMS v2 contract every plugin still decrypts older key ids), nor when m's plugin is the
// one that lags: no other member reports k's key id while the key id of some other
// member is reported by at least two. Two members whose plugins report different key
// ids, nobody else around: nothing says which lags, and both count.
func keyIDCounts(members []MemberState, m MemberState, k Key) bool {
	reported := func(s MemberState) string {
		for _, p := range s.KMS {
			if p.Name == k.Key {
				return p.ReportedKeyIDHash
			}
		}
		return ""
	}
	if k.KeyIDHash == "" || reported(m) != k.KeyIDHash {
		return k.KeyIDHash == "" || reported(m) == ""
	}
	count := map[string]int{}
	for _, o := range members {
		if id := reported(o); id != "" {
			count[id]++
		}
	}
	if count[k.KeyIDHash] > 1 {
		return true
	}
	for id, n := range count {
		if id != k.KeyIDHash && n > 1 {
			return false
		}
	}
	return true
}
