package cluster

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Key names one entry of a resource's chain: a provider and key name (KMS: the
// provider name and the "sha256:" hash of the key id its plugin reports). Never key
// material.
type Key = transformers.KeyInfo

// MemberState is what one apiserver publishes at <prefix>/members/<apiserver-id>
// under its lease. It holds names, hashes and times, never key material.
type MemberState struct {
	// APIServerID names the apiserver (--apiserver-id).
	APIServerID string `json:"apiserverID"`
	// ClusterID is the cluster's Identity.ClusterID: a record of another cluster sharing
	// the etcd is an unknown member, never a member.
	ClusterID string `json:"clusterID,omitempty"`
	// Version is the rekey build.
	Version string `json:"version,omitempty"`
	// ConfigHash is "sha256:<hex>" of the configuration file in use.
	ConfigHash string `json:"configHash"`
	// FIPS is whether the apiserver runs in FIPS 140-3 mode (crypto/fips140.Enabled);
	// nil in the records of versions that did not publish it.
	FIPS *bool `json:"fips,omitempty"`
	// Resources has one entry per resource rule of that configuration, in file order.
	Resources []ResourceState `json:"resources"`
	// KMS reports the health and key id hash of every KMS v2 provider.
	KMS []KMSState `json:"kms,omitempty"`
	// StorageMigration says what this apiserver migrates once it is the elected
	// migration leader, so `rekey rotate --wait` can refuse a rotation no live
	// apiserver would migrate instead of waiting for it forever. Nil in the records of
	// versions that did not publish it: they do not say.
	StorageMigration *StorageMigrationState `json:"storageMigration,omitempty"`
	// BackupRetention is this apiserver's --backup-retention (time.Duration text, "0s"
	// when off): its retention guard refuses a configuration that drops a key a
	// snapshot that old may need, so `rekey rotate` and `check-config` judge with the
	// largest one published, and the key ledger keeps what it covers. Empty in the
	// records of versions that did not publish it: unknown (PublishedRetention).
	BackupRetention string `json:"backupRetention,omitempty"`
	// KeyWrites counts, per key, the values this member sealed since it started (at
	// most maxPublishedKeyWrites keys, those with the most writes). The cluster's
	// lifetime totals are KeyTotal, under coordination.KeyWritesPrefix. Records of
	// versions that did not count leave it out.
	KeyWrites []transformers.KeyWrites `json:"keyWrites,omitempty"`
	// LastReloadError is the latest refused configuration, if it is newer than the one
	// in use.
	LastReloadError   string    `json:"lastReloadError,omitempty"`
	LastReloadErrorAt time.Time `json:"lastReloadErrorAt,omitzero"`
	// DisagreeingSince is when this member first saw the live members disagree about a
	// write key (zero while they agree); the status command raises the alarm from it.
	DisagreeingSince time.Time `json:"disagreeingSince,omitzero"`
	// Reduced names the texts cut from the published record to keep it under
	// maxMemberRecordBytes ("lastReloadError", "kms.lastError"); empty when nothing was.
	Reduced []string `json:"reduced,omitempty"`
	// PublishedAt is when this state was written.
	PublishedAt time.Time `json:"publishedAt"`
}

// ResourceState is one resource rule of a member.
type ResourceState struct {
	// Resource is the rule as written in the configuration ("secrets", "*.apps").
	Resource string `json:"resource"`
	// Write is the entry that writes now; zero (no provider) while the write fence
	// refuses writes.
	Write Key `json:"write"`
	// Refused is why the write fence refuses writes ("" while it writes).
	Refused string `json:"refused,omitempty"`
	// Read lists every entry the rule can read, in configuration order.
	Read []Key `json:"read"`
	// Held is the configuration's write key while the write fence holds it back; for
	// a KMS write key, also the key id its plugin reports while the provider's key-id
	// fence holds that back (Held.KeyIDHash differs from Write.KeyIDHash).
	Held *Key `json:"held,omitempty"`
	// HeldSince is when the fence started holding it.
	HeldSince time.Time `json:"heldSince,omitzero"`
}

// StorageMigrationState is what a member migrates (--storage-migration and
// --storage-migration-resources).
type StorageMigrationState struct {
	// Resources are the resources it migrates as leader ("secrets",
	// "deployments.apps", or a wildcard: "*.*" is every resource its rules cover);
	// empty when --storage-migration is off (it only takes inventories).
	Resources []string `json:"resources,omitempty"`
}

// Migrates reports whether the member migrates resource (as a rule or a resource list
// names it: "secrets", "deployments.apps"); known is false for a record that does not
// say (an older version).
func (s MemberState) Migrates(resource string) (migrates, known bool) {
	if s.StorageMigration == nil {
		return false, false
	}
	want := schema.ParseGroupResource(resource)
	// A wildcard ("*.*": every resource its rules cover) migrates what it matches.
	return slices.ContainsFunc(s.StorageMigration.Resources, func(r string) bool {
		return transformers.RuleCovers(schema.ParseGroupResource(r), want)
	}), true
}

// PublishedRetention is the member's --backup-retention; known is false for a record
// that does not say (an older version) or says something unreadable.
func (s MemberState) PublishedRetention() (retention time.Duration, known bool) {
	d, err := time.ParseDuration(s.BackupRetention)
	if err != nil || d < 0 {
		return 0, false
	}
	return d, true
}

// LargestRetention is the longest --backup-retention members publish, the apiservers
// that publish it (by apiserver id), and those whose retention is unknown.
func LargestRetention(members []MemberState) (longest time.Duration, by, unknown []string) {
	for _, m := range members {
		d, ok := m.PublishedRetention()
		switch {
		case !ok:
			unknown = append(unknown, m.APIServerID)
		case d > longest:
			longest, by = d, []string{m.APIServerID}
		case d == longest && d > 0:
			by = append(by, m.APIServerID)
		}
	}
	return longest, by, unknown
}

// KMSState is one KMS v2 provider of a member.
type KMSState struct {
	Name    string `json:"name"`
	Healthy bool   `json:"healthy"`
	// KeyIDHash is the key id new values are written under.
	KeyIDHash string `json:"keyIDHash,omitempty"`
	// ReportedKeyIDHash is the key id the plugin's last healthy Status reported: the
	// proof that this member can decrypt values written under it. The other members'
	// key-id fences wait for it.
	ReportedKeyIDHash string `json:"reportedKeyIDHash,omitempty"`
	// HeldKeyIDHash is the reported key id this member's fence holds back (it still
	// writes under KeyIDHash), since HeldSince.
	HeldKeyIDHash string    `json:"heldKeyIDHash,omitempty"`
	HeldSince     time.Time `json:"heldSince,omitzero"`
	LastError     string    `json:"lastError,omitempty"`
	// ReusedKeyIDHash is a superseded key id the member's plugin reports again (a
	// reuse), refused as a write key since ReusedSince; the cluster raises
	// ConditionKMSKeyIDReuse while one member has one.
	ReusedKeyIDHash string    `json:"reusedKeyIDHash,omitempty"`
	ReusedSince     time.Time `json:"reusedSince,omitzero"`
}

// CanDecryptKeyID reports whether the member's plugin of KMS provider name is known to
// decrypt values under keyIDHash: it reported that key id, or writes under it. A
// member without that provider has nothing to say about its key ids (ok false).
func (s MemberState) CanDecryptKeyID(name, keyIDHash string) (can, ok bool) {
	for _, k := range s.KMS {
		if k.Name != name {
			continue
		}
		return k.ReportedKeyIDHash == keyIDHash || k.KeyIDHash == keyIDHash, true
	}
	return false, false
}

// Marshal encodes s for etcd.
func (s MemberState) Marshal() ([]byte, error) { return json.Marshal(s) }

// ParseMemberState decodes a member key's value.
func ParseMemberState(data []byte) (MemberState, error) {
	var s MemberState
	if err := json.Unmarshal(data, &s); err != nil {
		return s, fmt.Errorf("member state is not valid JSON: %w", err)
	}
	if s.APIServerID == "" {
		return s, fmt.Errorf("member state has no apiserverID")
	}
	return s, nil
}

// stateFromStatus describes an agent's status document as a member state. held says,
// per resource, since when the fence holds its configured write key back.
func stateFromStatus(id, version string, st reload.Status, held map[string]time.Time, now time.Time) MemberState {
	fips := st.FIPS
	m := MemberState{APIServerID: id, Version: version, ConfigHash: st.ActiveConfigHash, FIPS: &fips, PublishedAt: now}
	for _, r := range st.Resources {
		rs := resourceState(r)
		if r.WriteIndex > 0 && len(r.ReadKeys) > 0 {
			k := r.ReadKeys[0]
			rs.Held, rs.HeldSince = &k, held[r.Resource]
		} else if r.KMS != nil && r.KMS.HeldKeyIDHash != "" {
			k := rs.Write
			k.KeyIDHash = r.KMS.HeldKeyIDHash
			rs.Held, rs.HeldSince = &k, r.KMS.HeldSince
		} else if r.KMS != nil && !r.KMS.FirstSeedHeldUntil.IsZero() && rs.Write.Provider == transformers.ProviderKMSv2 {
			// The first seed after a start (or of a new provider) writes nothing until
			// every other member's plugin reports its key id: published as held, not as
			// written, so no other member counts a key id nobody wrote with against its
			// readiness.
			k := rs.Write
			rs.Held, rs.Write = &k, Key{}
			rs.Refused = fmt.Sprintf("KMS v2 provider %q holds writes under its first key id %s until every apiserver's plugin reports it (at the latest until %s)",
				r.KMS.Name, k.KeyIDHash, r.KMS.FirstSeedHeldUntil.UTC().Format(time.RFC3339))
		}
		m.Resources = append(m.Resources, rs)
	}
	for _, k := range st.KMSProviders {
		m.KMS = append(m.KMS, KMSState{Name: k.Name, Healthy: k.Healthy, KeyIDHash: k.KeyIDHash, LastError: k.LastError,
			ReportedKeyIDHash: k.ReportedKeyIDHash, HeldKeyIDHash: k.HeldKeyIDHash, HeldSince: k.HeldSince,
			ReusedKeyIDHash: k.ReusedKeyIDHash, ReusedSince: k.ReusedSince})
	}
	if st.LastError != "" && st.LastErrorAt.After(st.LoadedAt) {
		m.LastReloadError, m.LastReloadErrorAt = st.LastError, st.LastErrorAt
	}
	return m
}

// resourceState is rule as a member publishes it, without holds.
func resourceState(rule transformers.RuleInfo) ResourceState {
	rs := ResourceState{Resource: rule.Resource, Read: slices.Clone(rule.ReadKeys), Refused: rule.WriteRefused}
	rs.Write, _ = rule.Writer()
	return rs
}

// configState is the member state a Set built from cfg would publish before any write
// fence or KMS plugin had a say: each rule writes with its first entry.
func configState(id string, cfg *config.Config) MemberState {
	m := MemberState{APIServerID: id}
	for _, r := range transformers.DescribeRules(cfg) {
		m.Resources = append(m.Resources, resourceState(r))
	}
	return m
}

// sameContent compares two states ignoring PublishedAt and the write counts: a count
// changes with every write, and a new count alone must not republish the record (it
// rides along with the next publication; the totals in etcd are the exact ones).
func sameContent(a, b MemberState) bool {
	a.PublishedAt, b.PublishedAt = time.Time{}, time.Time{}
	a.KeyWrites, b.KeyWrites = nil, nil
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return string(x) == string(y)
}

// memberList returns members sorted by id without skip's record, one record per id
// (the last one members has, as a map by id would keep): the shape in which the fence
// and the leader keep the member list, so that each question about it is one pass.
//
// A list already in that shape (a view's list, when skip is not in it) is kept, not
// copied: membersChanged hands its list over.
func memberList(members []MemberState, skip string) []MemberState {
	inShape := true
	for i, m := range members {
		if m.APIServerID == skip || i > 0 && members[i-1].APIServerID >= m.APIServerID {
			inShape = false
			break
		}
	}
	if inShape {
		return slices.Clip(members)
	}
	out := make([]MemberState, 0, len(members))
	for _, m := range members {
		if m.APIServerID != skip {
			out = append(out, m)
		}
	}
	if !slices.IsSortedFunc(out, byAPIServerID) { // a view's list comes sorted
		slices.SortStableFunc(out, byAPIServerID)
	}
	// Keep the last record of each id (the sort was stable).
	n := 0
	for _, m := range out {
		if n > 0 && out[n-1].APIServerID == m.APIServerID {
			n--
		}
		out[n] = m
		n++
	}
	return out[:n]
}

// byAPIServerID orders member records by apiserver id.
func byAPIServerID(a, b MemberState) int { return strings.Compare(a.APIServerID, b.APIServerID) }

// Rule returns the member's rule that serves resource (as a rule names it), found the
// way a Set finds it (transformers.Lookup: the same rule, else for a concrete resource
// the `*.<group>` rule, else `*.*`). A member with none of them stores resource as
// plaintext: ok is false and the rule reads and writes identity only.
func (s MemberState) Rule(resource string) (rule ResourceState, ok bool) {
	// The fence asks this of every member on every reload: scan the few rules rather
	// than build a map per question. The first rule naming a resource wins, as in a Set.
	rules := s.Resources
	find := func(gr schema.GroupResource) (ResourceState, bool) {
		for _, r := range rules {
			if schema.ParseGroupResource(r.Resource) == gr {
				return r, true
			}
		}
		return ResourceState{}, false
	}
	if _, r, ok := transformers.LookupFunc(find, schema.ParseGroupResource(resource)); ok {
		return r, true
	}
	none := transformers.NoRule(resource)
	return ResourceState{Resource: resource, Write: none.ReadKeys[0], Read: none.ReadKeys}, false
}
