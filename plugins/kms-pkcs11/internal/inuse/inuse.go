// Package inuse decides whether a key version may be retired or destroyed: not while
// anything the cluster keeps needs its key id. It reads what rekey's apiservers keep in
// etcd, never the plugin's own memory:
//
//   - stored objects: every value under the apiservers' --etcd-prefix, judged by its
//     bytes as rekey's inventory judges them (migrate.ClassifyValue): a KMS v2 value
//     names its key id, compared by its "sha256:<hex>" hash;
//   - retained backups: the key ledger (pkg/keyledger) with the largest of
//     --backup-retention and what the apiservers publish, judged by guard.CheckRetention;
//   - live apiservers: the member records (pkg/cluster) whose KMS v2 providers write
//     under, report, or hold back the key id.
//
// A refusal is an *Refused, which matches guard.ErrRefused, and says what needs the
// version and what to do, in the words rekey's own guard uses for local keys.
package inuse

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/keyledger"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
)

// pageSize bounds one etcd range request of the storage scan.
const pageSize = 500

// HashKeyID is how rekey's records name a KMS v2 key id: "sha256:<hex>".
func HashKeyID(keyID string) string { return state.KeyIDHash(keyID) }

// Options say where the cluster's records are.
type Options struct {
	Client *clientv3.Client
	// EtcdPrefix is the apiservers' --etcd-prefix (where stored objects are).
	EtcdPrefix string
	// CoordinationPrefix is the apiservers' --coordination-prefix (members, ledger).
	CoordinationPrefix string
	// Retention is --backup-retention as given; RetentionSet says it was given on the
	// command line (an apiserver that does not publish its own then counts as covered).
	Retention    time.Duration
	RetentionSet bool
	Now          time.Time
}

// Stored is one etcd directory holding values under the key id.
type Stored struct {
	// Dir is the resource directory ("/registry/secrets/").
	Dir string
	// Provider is the KMS v2 provider name in the stored prefix.
	Provider string
	Objects  int64
}

func (s Stored) String() string {
	return fmt.Sprintf("%d objects under %s (kms provider %q) are encrypted under it", s.Objects, s.Dir, s.Provider)
}

// Refused is a refusal to retire or destroy a key version. errors.Is(err,
// guard.ErrRefused) matches it.
type Refused struct {
	// Action is "retire" or "destroy"; Version names it: "version 3 (key id sha256:…)".
	Action, Version string
	Stored          []Stored
	Holds           []guard.RetentionHold
	Members         []string
}

// Is makes errors.Is(err, guard.ErrRefused) true.
func (r *Refused) Is(target error) bool { return target == guard.ErrRefused }

func (r *Refused) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "refusing to %s %s: the cluster still needs it:", r.Action, r.Version)
	item := func(s string) { b.WriteString("\n  - " + s) }
	for _, s := range r.Stored {
		item(s.String())
	}
	for _, m := range r.Members {
		item(m)
	}
	for _, h := range r.Holds {
		item(h.String())
	}
	if len(r.Stored) > 0 {
		b.WriteString("\nKeep this version until `rekey migrate` has rewritten the data and `rekey inventory` shows no object under its key id.")
	}
	if len(r.Members) > 0 {
		b.WriteString("\nKeep this version until every apiserver writes with its successor and the cluster's storage migration to it is verified (`rekey status` shows both).")
	}
	if len(r.Holds) > 0 {
		b.WriteString("\nKeep this version until the dates given (`rekey ledger` lists every key the cluster wrote with and when it retired). To drop it anyway (snapshots holding values under it cannot be restored), lower --" + guard.BackupRetentionFlag + ".")
	}
	b.WriteString("\nTo " + r.Action + " it anyway (the data under it becomes unreadable), pass --" + guard.OverrideFlag + ".")
	return b.String()
}

// Check returns a *Refused when anything in the cluster still needs keyID, nil when
// nothing does, and another error when it cannot tell (etcd does not answer): a
// version is never let go blind.
func Check(ctx context.Context, o Options, action, version, keyID string) error {
	hash := HashKeyID(keyID)
	r := &Refused{Action: action, Version: fmt.Sprintf("%s (key id %s)", version, hash)}
	var err error
	if r.Stored, err = storedUnder(ctx, o.Client, o.EtcdPrefix, hash); err != nil {
		return err
	}
	snap, err := cluster.ReadSnapshot(ctx, o.Client, o.CoordinationPrefix)
	if err != nil {
		return fmt.Errorf("cannot read the apiservers' member records under %s: %w; retry once etcd answers", coordination.MembersPrefix(o.CoordinationPrefix), err)
	}
	r.Members = membersUsing(snap.Members, hash)
	retention, source, err := effectiveRetention(snap.Members, o)
	if err != nil {
		return err
	}
	if retention > 0 {
		l, _, _, err := keyledger.Store{Client: o.Client, Key: keyledger.Key(o.CoordinationPrefix)}.Load(ctx)
		if err != nil {
			return fmt.Errorf("cannot read the key ledger at %s: %w; retry once etcd answers", keyledger.Key(o.CoordinationPrefix), err)
		}
		r.Holds = holds(l, hash, retention, source, o.Now)
	}
	if len(r.Stored) == 0 && len(r.Members) == 0 && len(r.Holds) == 0 {
		return nil
	}
	return r
}

// storedUnder counts the values under etcdPrefix whose KMS v2 key id hashes to hash,
// per resource directory and provider, reading every page at one revision.
func storedUnder(ctx context.Context, cli *clientv3.Client, etcdPrefix, hash string) ([]Stored, error) {
	root := strings.TrimSuffix(etcdPrefix, "/") + "/"
	end := clientv3.GetPrefixRangeEnd(root)
	counts := map[[2]string]int64{}
	var rev int64
	key := root
	for {
		opts := []clientv3.OpOption{clientv3.WithRange(end), clientv3.WithLimit(pageSize)}
		if rev != 0 {
			opts = append(opts, clientv3.WithRev(rev))
		}
		resp, err := cli.Get(ctx, key, opts...)
		if err != nil {
			return nil, fmt.Errorf("cannot scan the stored objects under %s: %w; retry once etcd answers", root, err)
		}
		if rev == 0 {
			rev = resp.Header.Revision
		}
		for _, kv := range resp.Kvs {
			b := migrate.ClassifyValue(kv.Value)
			if b.Provider != transformers.ProviderKMSv2 || b.KeyIDHash != hash {
				continue
			}
			counts[[2]string{resourceDir(root, string(kv.Key)), b.Key}]++
		}
		if !resp.More || len(resp.Kvs) == 0 {
			break
		}
		key = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
	var out []Stored
	for k, n := range counts {
		out = append(out, Stored{Dir: k[0], Provider: k[1], Objects: n})
	}
	slices.SortFunc(out, func(a, b Stored) int { return strings.Compare(a.Dir+a.Provider, b.Dir+b.Provider) })
	return out, nil
}

// resourceDir is the first directory below root of key: /registry/secrets/ for
// /registry/secrets/ns/name, /registry/example.com/widgets/ for a custom resource.
func resourceDir(root, key string) string {
	rel := strings.TrimPrefix(key, root)
	parts := strings.SplitN(rel, "/", 3)
	if len(parts) >= 2 && strings.Contains(parts[0], ".") {
		return root + parts[0] + "/" + parts[1] + "/"
	}
	return root + parts[0] + "/"
}

// membersUsing names the live apiservers whose KMS v2 provider writes under, reports,
// or holds back the key id.
func membersUsing(members []cluster.MemberState, hash string) []string {
	var out []string
	for _, m := range members {
		for _, k := range m.KMS {
			var how []string
			if k.KeyIDHash == hash {
				how = append(how, "writes under it")
			}
			if k.ReportedKeyIDHash == hash && k.KeyIDHash != hash {
				how = append(how, "reports it as its plugin's current key id")
			}
			if k.HeldKeyIDHash == hash {
				how = append(how, "holds it back in its key-id fence")
			}
			if len(how) > 0 {
				out = append(out, fmt.Sprintf("apiserver %s (kms provider %q) %s", m.APIServerID, k.Name, strings.Join(how, " and ")))
			}
		}
	}
	return out
}

// effectiveRetention is the retention the apiservers' own guards apply: the largest of
// the flag and what the live members publish, as rekey's CLI judges it. A member that
// does not publish its retention may hold backups longer, so that is an error unless
// the flag was given.
func effectiveRetention(members []cluster.MemberState, o Options) (time.Duration, string, error) {
	longest, by, unknown := cluster.LargestRetention(members)
	if len(unknown) > 0 && !o.RetentionSet {
		return 0, "", fmt.Errorf("the backup retention of the apiservers is unknown: apiserver %s does not publish its --%s (an older rekey); pass --%s with the longest retention any apiserver runs (0 if none checks one)",
			strings.Join(unknown, ", "), guard.BackupRetentionFlag, guard.BackupRetentionFlag)
	}
	if longest <= o.Retention {
		return o.Retention, "", nil
	}
	return longest, "published by apiserver " + strings.Join(by, ", "), nil
}

// holds are the ledger's reasons to keep the key id for the backups: its own entry,
// and, failing closed as guard.CheckRetention does, a KMS v2 history entry or the
// ledger's watermark of forgotten keys that may stand for it.
func holds(l *keyledger.Ledger, hash string, retention time.Duration, source string, now time.Time) []guard.RetentionHold {
	if l == nil {
		return nil
	}
	names := map[string]bool{}
	for _, e := range l.Entries {
		if e.Provider == transformers.ProviderKMSv2 && (e.KeyIDHash == hash || e.IsHistory()) {
			names[e.Name] = true
		}
	}
	if len(names) == 0 && l.Forgotten != nil {
		names[""] = true // no entry knows it: only the watermark may hold it
	}
	var out []guard.RetentionHold
	for name := range names {
		cur := []transformers.Entry[transformers.KeyInfo]{{Resources: []string{"secrets"}, Items: []transformers.KeyInfo{{Provider: transformers.ProviderKMSv2, Key: name, KeyIDHash: hash}}}}
		for _, h := range guard.CheckRetention(l, cur, nil, retention, now) {
			if h.Forgotten == nil && h.Key.KeyIDHash != hash && !h.Key.IsHistory() {
				continue // another key id of the same provider
			}
			h.Source = source
			out = append(out, h)
		}
	}
	slices.SortFunc(out, func(a, b guard.RetentionHold) int { return a.Until.Compare(b.Until) })
	return out
}
