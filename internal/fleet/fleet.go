// Package fleet is what `rekey fleet status` decides, apart from reading etcd: the
// fleet file, the rules a cluster's apiservers publish turned into an inventory's
// source, and one row per cluster with whether it needs attention.
package fleet

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/rekey-io/rekey/api/v1alpha1"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/encryptionstate"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// File is a fleet file: one entry per control plane.
type File struct {
	// Concurrency bounds how many clusters are read at once (default 8).
	Concurrency int       `json:"concurrency,omitempty"`
	Clusters    []Cluster `json:"clusters"`
}

// Cluster is one control plane: where its etcd is and the prefixes it stores under.
// Several entries may name one etcd with different prefixes (Kamaji: many control
// planes on one etcd).
type Cluster struct {
	Name         string   `json:"name"`
	EtcdServers  []string `json:"etcdServers"`
	EtcdCAFile   string   `json:"etcdCAFile,omitempty"`
	EtcdCertFile string   `json:"etcdCertFile,omitempty"`
	EtcdKeyFile  string   `json:"etcdKeyFile,omitempty"`
	// EtcdPrefix is its apiservers' --etcd-prefix (default /registry).
	EtcdPrefix string `json:"etcdPrefix,omitempty"`
	// CoordinationPrefix is its apiservers' --coordination-prefix (default: derived
	// from EtcdPrefix as the apiservers derive it).
	CoordinationPrefix string `json:"coordinationPrefix,omitempty"`
	// Kubeconfig, instead of etcd, reads the cluster's rekey.io/v1alpha1
	// EncryptionState through its apiservers (a distribution with rekey inside, or
	// the shim): what the migration leader last counted, with no etcd access. Context
	// picks the kubeconfig's context (default: its current one).
	Kubeconfig string `json:"kubeconfig,omitempty"`
	Context    string `json:"context,omitempty"`
}

// DefaultConcurrency is how many clusters are read at once unless the file says.
const DefaultConcurrency = 8

// Load reads and checks a fleet file (strict: an unknown field is an error).
func Load(path string) (*File, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var f File
	if err := yaml.UnmarshalStrict(data, &f); err != nil {
		return nil, fmt.Errorf("fleet file %s: %v", path, err)
	}
	if len(f.Clusters) == 0 {
		return nil, fmt.Errorf("fleet file %s names no clusters (clusters: [{name, etcdServers, etcdPrefix} or {name, kubeconfig, context}, ...])", path)
	}
	if f.Concurrency <= 0 {
		f.Concurrency = DefaultConcurrency
	}
	seen := map[string]bool{}
	for i, c := range f.Clusters {
		if c.Name == "" {
			return nil, fmt.Errorf("fleet file %s: clusters[%d] has no name", path, i)
		}
		if seen[c.Name] {
			return nil, fmt.Errorf("fleet file %s: two clusters are named %q", path, c.Name)
		}
		seen[c.Name] = true
		switch {
		case c.Kubeconfig != "" && (len(c.EtcdServers) > 0 || c.EtcdPrefix != "" || c.CoordinationPrefix != ""):
			return nil, fmt.Errorf("fleet file %s: cluster %q names both a kubeconfig and etcd: keep one (kubeconfig reads its EncryptionState API, etcdServers its etcd)", path, c.Name)
		case c.Kubeconfig != "":
			continue
		case c.Context != "":
			return nil, fmt.Errorf("fleet file %s: cluster %q has a context but no kubeconfig", path, c.Name)
		case len(c.EtcdServers) == 0:
			return nil, fmt.Errorf("fleet file %s: cluster %q has neither etcdServers nor a kubeconfig", path, c.Name)
		}
		if c.EtcdPrefix == "" {
			f.Clusters[i].EtcdPrefix = migrate.DefaultEtcdPrefix
		}
	}
	return &f, nil
}

// Rules are the resource rules the live apiservers publish, from the member on the
// configuration most of them run (ties: the first by id), for an inventory's source
// (migrate.FromRules); nil without members. Each read key's stored prefix comes from
// transformers.KeyInfo.StoredPrefix, a KMS v2 writer's key id hash from its record.
func Rules(members []cluster.MemberState) []transformers.RuleInfo {
	m, ok := majority(members)
	if !ok {
		return nil
	}
	var out []transformers.RuleInfo
	for _, r := range m.Resources {
		ri := transformers.RuleInfo{Resource: r.Resource, WriteProvider: r.Write.Provider, WriteKey: r.Write.Key, WritePrefix: r.Write.StoredPrefix()}
		if r.Write.Provider == transformers.ProviderKMSv2 {
			ri.KMS = &transformers.KMSStatus{Name: r.Write.Key, KeyIDHash: r.Write.KeyIDHash}
		}
		for i, k := range r.Read {
			ri.ReadPrefixes = append(ri.ReadPrefixes, k.StoredPrefix())
			ri.ReadKeys = append(ri.ReadKeys, k)
			if k.SameEntry(r.Write) && r.Write.Provider != "" {
				ri.WriteIndex = i
			}
		}
		out = append(out, ri)
	}
	return out
}

// majority is a member on the configuration hash most members run.
func majority(members []cluster.MemberState) (cluster.MemberState, bool) {
	if len(members) == 0 {
		return cluster.MemberState{}, false
	}
	count := map[string]int{}
	for _, m := range members {
		count[m.ConfigHash]++
	}
	best := members[0]
	for _, m := range members {
		if count[m.ConfigHash] > count[best.ConfigHash] {
			best = m
		}
	}
	return best, true
}

// AESGCMWriteBudget is how many values one aesgcm key may seal (its owner is
// pkg/encryptionstate, whose API reports it per key).
const AESGCMWriteBudget = encryptionstate.AESGCMWriteBudget

// Row is one cluster of the fleet view.
type Row struct {
	Name      string `json:"name"`
	ClusterID string `json:"clusterID,omitempty"`
	// Revision is the etcd revision the inventory read (one per cluster).
	Revision   int64 `json:"revision,omitempty"`
	APIServers int   `json:"apiservers"`
	// WriteKey is the oldest write key of the cluster's resources (the first rule's
	// when their ages are unknown), WriteKeyAge its age from the cluster's key-write
	// totals (zero when unknown).
	WriteKey    string        `json:"writeKey,omitempty"`
	WriteKeyAge time.Duration `json:"writeKeyAge,omitempty"`
	Objects     int64         `json:"objects"`
	// NotOnWriteKey counts objects not written with their resource's write key (stale
	// and unreadable); Plaintext those stored in plaintext, whatever the rule writes.
	NotOnWriteKey int64 `json:"notOnWriteKey"`
	Plaintext     int64 `json:"plaintext"`
	Unreadable    int64 `json:"unreadable"`
	// Stragglers are live apiservers on another configuration than most, plus
	// records that are not live members of this cluster.
	Stragglers int `json:"stragglers"`
	// BudgetUsed is the largest share of an aesgcm write key's budget its writes used
	// (AESGCMWriteBudget); negative when unknown.
	BudgetUsed float64 `json:"budgetUsed"`
	// FIPS is "on", "off", "mixed" or "" (no apiserver says).
	FIPS string `json:"fips,omitempty"`
	// Verdict is the members' convergence (cluster.Evaluate's summary).
	Verdict string `json:"verdict,omitempty"`
	// Error is why the cluster could not be read.
	Error string `json:"error,omitempty"`
	// Attention lists what needs an operator; empty when nothing does.
	Attention []string `json:"attention,omitempty"`
}

// NeedsAttention reports whether the row lists anything to look at.
func (r Row) NeedsAttention() bool { return len(r.Attention) > 0 }

// Summarize makes a cluster's row from its snapshot (members, identity), the
// inventory taken with Rules(snap.Members) and the cluster's key-write totals.
func Summarize(name string, snap *cluster.Snapshot, inv *migrate.Inventory, totals []cluster.KeyTotal, now time.Time, alarm time.Duration) Row {
	r := Row{Name: name, BudgetUsed: -1}
	if snap.Identity != nil {
		r.ClusterID = snap.Identity.ClusterID
	}
	r.APIServers = len(snap.Members)
	if m, ok := majority(snap.Members); ok {
		for _, o := range snap.Members {
			if o.ConfigHash != m.ConfigHash {
				r.Stragglers++
			}
		}
		r.WriteKey, r.WriteKeyAge = oldestWriteKey(m, totals, now)
	}
	r.Stragglers += len(snap.UnknownMembers)
	r.FIPS = fipsOf(snap.Members)
	if len(snap.Members) > 0 {
		v := cluster.Evaluate(snap.Members, snap.Migration, now, alarm)
		r.Verdict = v.Summary
		if !v.Converged {
			r.Attention = append(r.Attention, "apiservers: "+v.Summary)
		}
	}
	for _, t := range totals {
		if t.Provider == transformers.ProviderAESGCM {
			r.BudgetUsed = max(r.BudgetUsed, float64(t.Writes)/AESGCMWriteBudget)
		}
	}
	for _, ri := range inv.Resources {
		r.Revision = max(r.Revision, ri.Revision)
		r.Objects += ri.Objects
		r.NotOnWriteKey += ri.Stale + ri.Unreadable - ri.Acknowledged
		r.Unreadable += ri.Unreadable - ri.Acknowledged
		r.Plaintext += ri.Plaintext
		if ri.WritePrefix == "" && ri.Plaintext > 0 && len(snap.Members) > 0 {
			r.Attention = append(r.Attention, fmt.Sprintf("%s: written in plaintext (its rule writes identity)", ri.Resource))
		}
	}
	if r.Plaintext > 0 {
		r.Attention = append(r.Attention, fmt.Sprintf("%d objects in plaintext", r.Plaintext))
	}
	if n := r.NotOnWriteKey - r.Plaintext; n > 0 {
		r.Attention = append(r.Attention, fmt.Sprintf("%d objects not on their write key", n))
	}
	if r.Stragglers > 0 {
		r.Attention = append(r.Attention, fmt.Sprintf("%d stragglers", r.Stragglers))
	}
	if r.APIServers == 0 {
		r.Attention = append(r.Attention, "no live apiserver publishes its keys: classified as plaintext-only")
	}
	if r.BudgetUsed >= 0.5 {
		r.Attention = append(r.Attention, fmt.Sprintf("an aesgcm key used %.0f%% of its write budget: rotate", 100*r.BudgetUsed))
	}
	return r
}

// StateMaxAge is how old an EncryptionState's newest inventory may be before its row
// says the state is not kept current (the layer takes one every few minutes).
const StateMaxAge = time.Hour

// SummarizeState makes a cluster's row from its EncryptionState, read through the
// apiservers (an entry with a kubeconfig): the same row Summarize makes from etcd, from
// what the migration leader counted. Stragglers are apiservers that do not agree with
// the writer's configuration; the verdict is the writer's.
func SummarizeState(name string, st *v1alpha1.EncryptionState, now time.Time) Row {
	s := st.Status
	r := Row{Name: name, ClusterID: s.ClusterID, APIServers: len(s.APIServers), BudgetUsed: -1,
		Objects: s.Totals.Objects, Plaintext: s.Totals.Plaintext, Unreadable: s.Totals.Unreadable - s.Totals.Acknowledged,
		NotOnWriteKey: s.Totals.Stale + s.Totals.Unreadable - s.Totals.Acknowledged}
	var on, off int
	for _, a := range s.APIServers {
		if !a.Agrees {
			r.Stragglers++
		}
		switch a.FIPS {
		case "on", "only":
			on++
		case "off":
			off++
		}
	}
	r.FIPS = fipsName(on, off)
	r.Verdict = "written by " + s.ObservedBy
	if r.Stragglers > 0 {
		r.Attention = append(r.Attention, fmt.Sprintf("apiservers: %d do not run the configuration of %s", r.Stragglers, s.ObservedBy))
	}
	var newest time.Time
	for _, res := range s.Resources {
		r.Revision = max(r.Revision, res.Revision)
		if t := res.InventoryTime.Time; t.After(newest) {
			newest = t
		}
		if res.WriteKey.Provider == transformers.ProviderIdentity && res.Plaintext > 0 && len(s.APIServers) > 0 {
			r.Attention = append(r.Attention, fmt.Sprintf("%s: written in plaintext (its rule writes identity)", res.Resource))
		}
		if r.WriteKey == "" && res.WriteKey.Provider != transformers.ProviderIdentity {
			r.WriteKey = keyName(res.WriteKey.Provider, res.WriteKey.Name)
		}
		for _, k := range res.Keys {
			if k.Current && k.Age != nil && k.Age.Duration > r.WriteKeyAge {
				r.WriteKey, r.WriteKeyAge = keyName(k.Provider, k.Name), k.Age.Duration
			}
			if k.WriteBudget > 0 {
				r.BudgetUsed = max(r.BudgetUsed, float64(k.Writes)/float64(k.WriteBudget))
			}
		}
	}
	if r.Plaintext > 0 {
		r.Attention = append(r.Attention, fmt.Sprintf("%d objects in plaintext", r.Plaintext))
	}
	if n := r.NotOnWriteKey - r.Plaintext; n > 0 {
		r.Attention = append(r.Attention, fmt.Sprintf("%d objects not on their write key", n))
	}
	if r.Stragglers > 0 {
		r.Attention = append(r.Attention, fmt.Sprintf("%d stragglers", r.Stragglers))
	}
	if r.BudgetUsed >= 0.5 {
		r.Attention = append(r.Attention, fmt.Sprintf("an aesgcm key used %.0f%% of its write budget: rotate", 100*r.BudgetUsed))
	}
	if newest.IsZero() || now.Sub(newest) > StateMaxAge {
		r.Attention = append(r.Attention, fmt.Sprintf("the EncryptionState holds no inventory newer than %s: is a migration leader running?", StateMaxAge))
	}
	return r
}

// keyName is "aesgcm/key1", as KeyInfo.String names a key without its key id.
func keyName(provider, name string) string {
	if name == "" {
		return provider
	}
	return provider + "/" + name
}

// oldestWriteKey is the write key of m's rules whose key-write total is oldest.
func oldestWriteKey(m cluster.MemberState, totals []cluster.KeyTotal, now time.Time) (string, time.Duration) {
	var name string
	var age time.Duration
	for _, r := range m.Resources {
		if r.Write.Provider == "" {
			continue
		}
		if name == "" {
			name = r.Write.String()
		}
		for _, t := range totals {
			if t.Provider == r.Write.Provider && t.Key.Key == r.Write.Key && t.Check == r.Write.Check && t.KeyIDHash == r.Write.KeyIDHash {
				if a := t.Age(now); a > age {
					name, age = r.Write.String(), a
				}
			}
		}
	}
	return name, age
}

func fipsOf(members []cluster.MemberState) string {
	var on, off int
	for _, m := range members {
		switch {
		case m.FIPS == nil:
		case *m.FIPS:
			on++
		default:
			off++
		}
	}
	return fipsName(on, off)
}

// fipsName is "on", "off", "mixed" or "" (no apiserver says).
func fipsName(on, off int) string {
	switch {
	case on > 0 && off > 0:
		return "mixed"
	case on > 0:
		return "on"
	case off > 0:
		return "off"
	}
	return ""
}

// Sort orders rows: those needing attention first, then by name.
func Sort(rows []Row) {
	slices.SortFunc(rows, func(a, b Row) int {
		if a.NeedsAttention() != b.NeedsAttention() {
			if a.NeedsAttention() {
				return -1
			}
			return 1
		}
		return strings.Compare(a.Name, b.Name)
	})
}
