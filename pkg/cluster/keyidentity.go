package cluster

import (
	"fmt"
	"slices"
	"strings"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// This file is the one statement of what "the same key" means between apiservers and
// of who the straggler is; the fence, readiness, the guard, the verdict and the leader
// ask it.
//
// A key is its provider, name and check value (transformers.KeyInfo.Match); a KMS key
// is its provider name and the key id written under, which a member can read only when
// its plugin decrypts that key id (MemberState.CanDecryptKeyID). A local key published
// without a check value (a record of an older rekey) is "unverified": nothing proves
// its secret equal or different. Promotion and migration need proof (fail closed);
// readiness, the guard and the straggler rule treat it as readable, as names were
// before, so a rolling upgrade neither takes the new members out of service nor lets a
// key be dropped that may be in use.

// Reads compares k with the entries of the member's rule for resource: KeysSame when
// an entry is k (for a KMS key with a key id: the member's plugin also decrypts that key
// id), KeysConflict when an entry has k's name and another secret, KeysUnverified when
// nothing proves either (no check value, or no KMS state for the provider), KeysDiffer
// otherwise. The best of its entries counts.
func (s MemberState) Reads(resource string, k Key) transformers.KeyMatch {
	r, _ := s.Rule(resource)
	best := transformers.KeysDiffer
	for _, e := range r.Read {
		m := e.Match(k)
		if m == transformers.KeysSame && k.Provider == transformers.ProviderKMSv2 && k.KeyIDHash != "" {
			switch can, ok := s.CanDecryptKeyID(k.Key, k.KeyIDHash); {
			case !ok:
				m = transformers.KeysUnverified
			case !can:
				m = transformers.KeysDiffer
			}
		}
		if rank(m) > rank(best) {
			best = m
		}
	}
	return best
}

// rank orders matches from worst to best for Reads.
func rank(m transformers.KeyMatch) int {
	switch m {
	case transformers.KeysSame:
		return 3
	case transformers.KeysUnverified:
		return 2
	case transformers.KeysConflict:
		return 1
	}
	return 0
}

// CanRead reports whether the member's rule for resource provably reads k (Reads is
// KeysSame): what promotion needs.
func (s MemberState) CanRead(resource string, k Key) bool {
	return s.Reads(resource, k) == transformers.KeysSame
}

// mayRead reports whether nothing proves that the member cannot read k (Reads is
// KeysSame or KeysUnverified): what readiness, the guard and the straggler rule use.
func (s MemberState) mayRead(resource string, k Key) bool {
	m := s.Reads(resource, k)
	return m == transformers.KeysSame || m == transformers.KeysUnverified
}

// writes returns the key the member writes resource with; ok is false while its write
// fence refuses writes.
func (s MemberState) writes(resource string) (Key, bool) {
	r, _ := s.Rule(resource)
	return r.Write, r.Write.Provider != ""
}

// stragglers returns the members (by id) that straggle for resource. A member
// straggles when
//   - no other live member may read the key it writes with, and
//   - it cannot read the write key of another member that is not in that situation
//     (whose write key at least one member besides itself may read).
//
// The second condition is what tells the one that lags from the ones that moved on:
// two members that cannot read each other's write key with nobody else around are
// both "in that situation", so neither straggles — nothing says which lags, and both
// fail readiness. A member whose fence refuses writes writes nothing and is neither.
//
// members is a member list (distinct ids). Readability is asked once per member and
// distinct write key, never per pair of members: a cluster has few write keys and may
// have many members, and every fence asks this on every reload.
func stragglers(members []MemberState, resource string) map[string]bool {
	var keys []Key                      // the distinct write keys
	writes := make([]int, len(members)) // index in keys of each member's write key; -1 when it refuses
	for i, m := range members {
		w, ok := m.writes(resource)
		if !ok {
			writes[i] = -1
			continue
		}
		j := slices.Index(keys, w)
		if j < 0 {
			j = len(keys)
			keys = append(keys, w)
		}
		writes[i] = j
	}
	// reads[i*len(keys)+j]: member i may read keys[j]; readers[j]: how many may.
	reads := make([]bool, len(members)*len(keys))
	readers := make([]int, len(keys))
	for i, m := range members {
		for j, k := range keys {
			if m.mayRead(resource, k) {
				reads[i*len(keys)+j] = true
				readers[j]++
			}
		}
	}
	readByOther := func(i int) bool {
		j := writes[i]
		others := readers[j]
		if reads[i*len(keys)+j] {
			others--
		}
		return others > 0
	}
	// moved[j]: keys[j] is the write key of a member whose write key another reads.
	moved := make([]bool, len(keys))
	for i, j := range writes {
		if j >= 0 && readByOther(i) {
			moved[j] = true
		}
	}
	out := map[string]bool{}
	for i, m := range members {
		if writes[i] < 0 || readByOther(i) {
			continue
		}
		// The members that made a key moved are read by another; this one is not, so
		// they are other members.
		for j := range keys {
			if moved[j] && !reads[i*len(keys)+j] {
				out[m.APIServerID] = true
				break
			}
		}
	}
	return out
}

// straggles reports whether self straggles among members (stragglers); self's record
// in members, if any, is the one self replaces. It is what a fence asks of itself on
// every reload, and the usual answer — another member may read its write key — needs
// neither a copy of the list nor a look at the other members' keys.
func straggles(members []MemberState, self MemberState, resource string) bool {
	id := self.APIServerID
	w, writing := self.writes(resource)
	if !writing || slices.ContainsFunc(members, func(o MemberState) bool { return o.APIServerID != id && o.mayRead(resource, w) }) {
		return false
	}
	all := append(slices.DeleteFunc(slices.Clone(members), func(o MemberState) bool { return o.APIServerID == id }), self)
	return stragglers(all, resource)[id]
}

// Conflict is one key name with more than one secret among the live members.
type Conflict struct {
	Resource string `json:"resource"`
	// Key names the key (provider and name; no check value).
	Key Key `json:"key"`
	// Members maps each check value to the members (sorted) whose rule has the key
	// with it.
	Members map[string][]string `json:"members"`
}

// String is "secrets: aesgcm/k1 has 2 secrets: check 1a2b… on a,b; check 3c4d… on c".
func (c Conflict) String() string {
	checks := make([]string, 0, len(c.Members))
	for check := range c.Members {
		checks = append(checks, check)
	}
	slices.Sort(checks)
	parts := make([]string, 0, len(checks))
	for _, check := range checks {
		parts = append(parts, fmt.Sprintf("check %s on %s", check, strings.Join(c.Members[check], ",")))
	}
	return fmt.Sprintf("%s: %s has %d secrets: %s", c.Resource, c.Key, len(checks), strings.Join(parts, "; "))
}

// involves reports whether member id has one of the conflicting secrets.
func (c Conflict) involves(id string) bool {
	for _, ids := range c.Members {
		if slices.Contains(ids, id) {
			return true
		}
	}
	return false
}

// keyConflicts lists the keys that live members have under one name with different
// secrets (check values), by resource in order of first appearance. Entries without a
// check value (older records, KMS, identity) never conflict.
func keyConflicts(members []MemberState) []Conflict {
	var resources []string
	for _, m := range members {
		for _, r := range m.Resources {
			if !slices.Contains(resources, r.Resource) {
				resources = append(resources, r.Resource)
			}
		}
	}
	var out []Conflict
	for _, res := range resources {
		var order []Key
		byKey := map[Key]map[string][]string{}
		for _, m := range members {
			r, _ := m.Rule(res)
			for _, k := range r.Read {
				if k.Check == "" {
					continue
				}
				name := Key{Provider: k.Provider, Key: k.Key}
				if byKey[name] == nil {
					byKey[name] = map[string][]string{}
					order = append(order, name)
				}
				if !slices.Contains(byKey[name][k.Check], m.APIServerID) {
					byKey[name][k.Check] = append(byKey[name][k.Check], m.APIServerID)
				}
			}
		}
		for _, name := range order {
			if len(byKey[name]) < 2 {
				continue
			}
			for _, ids := range byKey[name] {
				slices.Sort(ids)
			}
			out = append(out, Conflict{Resource: res, Key: name, Members: byKey[name]})
		}
	}
	return out
}
