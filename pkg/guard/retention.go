package guard

import (
	"context"
	"encoding/hex"
	"fmt"
	"strings"
	"time"

	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/keyledger"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// BackupRetentionFlag is the flag of the layer and of the CLI commands that remove
// keys: how long the operator keeps etcd backups. Its default, 0, checks nothing: a
// cluster without backups must not keep old keys for them. Set it to the age of the
// oldest etcd snapshot you may restore (e.g. 168h for a week of daily snapshots).
const BackupRetentionFlag = "backup-retention"

// RetentionHold is one key a configuration drops that a snapshot kept within the
// backup retention may still need.
type RetentionHold struct {
	// Key is the ledger's entry: provider, name, check value or KMS key id hash (for a
	// key the ledger does not know, the dropped key as the configuration names it).
	Key keyledger.Entry
	// Until is when the retention lets it go.
	Until time.Time
	// NeededFor is the age of the youngest snapshot that may hold values under it
	// (0 while it is not retired: one taken now may).
	NeededFor time.Duration
	// Retention is the --backup-retention it was judged with, and Source whose it is
	// (RetentionOptions.Source).
	Retention time.Duration
	Source    string
	// Forgotten is set when the ledger does not know the key but forgot keys retired
	// up to it (keyledger.Ledger.Forgotten): the key may be one of them.
	Forgotten *keyledger.Event
}

const holdTimeLayout = "2006-01-02T15:04Z"

func (h RetentionHold) String() string {
	what := h.Key.String()
	retention := "--" + BackupRetentionFlag + " " + h.Retention.String()
	if h.Source != "" {
		retention += " " + h.Source
	}
	switch {
	case h.Forgotten != nil:
		return fmt.Sprintf("the key ledger does not know %s, and it forgot keys retired up to %s (revision %d) to stay within %d entries: %s may be one of them, so a snapshot up to %s old may hold values under it: keep it until %s, when %s lets go of every key the ledger forgot",
			what, h.Forgotten.At.Format(holdTimeLayout), h.Forgotten.Revision, keyledger.MaxHeldEntries, what, roundAge(h.Retention), h.Until.Format(holdTimeLayout), retention)
	case h.Key.Retired == nil:
		return fmt.Sprintf("%s was last written at %s (revision %d) and no inventory since has found it gone from storage, so a snapshot taken now may hold values under it: keep it until at least %s (now + %s)",
			what, h.Key.LastUse.At.Format(holdTimeLayout), h.Key.LastUse.Revision, h.Until.Format(holdTimeLayout), retention)
	}
	s := fmt.Sprintf("a snapshot up to %s old may hold values under %s (last written at %s, retired at %s, revision %d): keep it until %s, when %s lets it go",
		roundAge(h.Retention), what, h.Key.LastUse.At.Format(holdTimeLayout), h.Key.Retired.At.Format(holdTimeLayout), h.Key.Retired.Revision, h.Until.Format(holdTimeLayout), retention)
	if h.NeededFor >= time.Minute {
		s += fmt.Sprintf(" (sooner only if no snapshot older than %s is kept: a --%s of %s or less)", floorAge(h.NeededFor), BackupRetentionFlag, floorAge(h.NeededFor))
	}
	return s
}

// roundAge renders an age in days and hours when it is that long, rounded.
func roundAge(d time.Duration) string {
	d = d.Round(time.Minute)
	if d >= 24*time.Hour {
		d = d.Round(time.Hour)
	}
	return ageText(d)
}

// floorAge renders an age rounded down (to whole hours from a day on), so that a
// retention of at most it is one that lets a key go.
func floorAge(d time.Duration) string {
	d = d.Truncate(time.Minute)
	if d >= 24*time.Hour {
		d = d.Truncate(time.Hour)
	}
	return ageText(d)
}

// ageText renders a whole number of minutes as "7d", "1d12h", "1h", "1h30m" or "45m".
func ageText(d time.Duration) string {
	days, hours, minutes := d/(24*time.Hour), d%(24*time.Hour)/time.Hour, d%time.Hour/time.Minute
	var b strings.Builder
	if days > 0 {
		fmt.Fprintf(&b, "%dd", days)
	}
	if hours > 0 {
		fmt.Fprintf(&b, "%dh", hours)
	}
	if minutes > 0 || b.Len() == 0 {
		fmt.Fprintf(&b, "%dm", minutes)
	}
	return b.String()
}

// CheckRetention lists the keys next drops (current's rules read them for a resource,
// next's do not) that a snapshot taken within retention may need, per the ledger: a
// key retired less than retention ago, or not retired at all. A key the ledger does
// not know was never written with by a member that recorded it, unless the ledger
// forgot it to stay within its bound: while a key it forgot (retired up to
// Ledger.Forgotten) may be needed, an unknown key is held too (fail closed).
// retention <= 0 checks nothing.
func CheckRetention(l *keyledger.Ledger, current, next []transformers.Entry[transformers.KeyInfo], retention time.Duration, now time.Time) []RetentionHold {
	if retention <= 0 || l == nil {
		return nil
	}
	var out []RetentionHold
	seen := map[keyledger.Entry]bool{}
	for _, k := range DroppedKeys(current, next) {
		entries := l.Of(k)
		if len(entries) == 0 && l.Forgotten != nil {
			if until := l.Forgotten.At.Add(retention); now.Before(until) {
				forgotten := *l.Forgotten
				out = append(out, RetentionHold{Key: keyledger.Entry{Provider: k.Provider, Name: k.Key, Check: k.Check, KeyIDHash: k.KeyIDHash},
					Until: until, NeededFor: max(now.Sub(forgotten.At), 0), Retention: retention, Forgotten: &forgotten})
			}
			continue
		}
		for _, e := range entries {
			anchor, needed := now, time.Duration(0)
			if e.Retired != nil {
				anchor, needed = e.Retired.At, now.Sub(e.Retired.At)
			}
			until := anchor.Add(retention)
			if !now.Before(until) || seen[e] {
				continue
			}
			seen[e] = true
			out = append(out, RetentionHold{Key: e, Until: until, NeededFor: needed, Retention: retention})
		}
	}
	return out
}

// retentionRefusalMark is in the first line of every backup-retention refusal
// (RefusedError.Error with Check Retention).
const retentionRefusalMark = "an etcd snapshot kept within --" + BackupRetentionFlag + " may need"

// RetentionRefusal reports whether text, a refused configuration as an apiserver
// publishes it (reload.Status.LastError, cluster.MemberState.LastReloadError), is the
// backup-retention guard's refusal, and returns its first hold ("" when the text was
// cut before it).
func RetentionRefusal(text string) (firstHold string, ok bool) {
	first, rest, _ := strings.Cut(text, "\n")
	if !strings.Contains(first, retentionRefusalMark) {
		return "", false
	}
	hold, _, _ := strings.Cut(rest, "\n")
	if h, isHold := strings.CutPrefix(hold, "  - "); isHold {
		return h, true
	}
	return "", true
}

// DroppedKeys lists the keys that some resource's chain reads under current and not
// under next (by provider, name and check value; KMS v2 by provider and name), each
// once; identity is no key.
func DroppedKeys(current, next []transformers.Entry[transformers.KeyInfo]) []transformers.KeyInfo {
	cur, order := transformers.ByResource(current)
	nxt, nextOrder := transformers.ByResource(next)
	var out []transformers.KeyInfo
	seen := map[transformers.KeyInfo]bool{}
	for _, gr := range append(order, nextOrder...) {
		cc, _ := transformers.Lookup(cur, gr)
		nc, _ := transformers.Lookup(nxt, gr)
		for _, k := range cc {
			if k.Provider == transformers.ProviderIdentity || seen[k] || readsKey(nc, k) {
				continue
			}
			seen[k] = true
			out = append(out, k)
		}
	}
	return out
}

func readsKey(chain []transformers.KeyInfo, k transformers.KeyInfo) bool {
	for _, c := range chain {
		if c.SameKey(k) {
			return true
		}
	}
	return false
}

// ConfigKeys describes cfg's rules as CheckRetention takes them.
func ConfigKeys(cfg *config.Config) []transformers.Entry[transformers.KeyInfo] {
	var out []transformers.Entry[transformers.KeyInfo]
	for _, e := range transformers.Describe(cfg) {
		keys := make([]transformers.KeyInfo, len(e.Items))
		for i, k := range e.Items {
			keys[i] = k.Info()
		}
		out = append(out, transformers.Entry[transformers.KeyInfo]{Resources: e.Resources, Items: keys})
	}
	return out
}

// appliedKeys describes an applied state's rules as CheckRetention takes them: the
// check value is the fingerprint's first bytes, as transformers computes it.
func appliedKeys(s *AppliedState) []transformers.Entry[transformers.KeyInfo] {
	if s == nil {
		return nil
	}
	var out []transformers.Entry[transformers.KeyInfo]
	for _, r := range s.Rules {
		keys := make([]transformers.KeyInfo, len(r.Keys))
		for i, k := range r.Keys {
			keys[i] = transformers.KeyInfo{Provider: k.Provider, Key: k.Name}
			// fingerprint, not the stored text: a KMS v1 entry of an older record carries
			// its endpoint's spelling, which fingerprint maps to the socket's.
			if fp, ok := k.fingerprint(); ok {
				keys[i].Check = hex.EncodeToString(fp[:])[:len(transformers.CheckValue("", nil))]
			}
		}
		out = append(out, transformers.Entry[transformers.KeyInfo]{Resources: r.Resources, Items: keys})
	}
	return out
}

// RetentionOptions configure the backup-retention check of a running apiserver
// (NewRetention) and of its start (StartupOptions.Retention).
type RetentionOptions struct {
	// Retention is --backup-retention; <= 0 checks nothing.
	Retention time.Duration
	// Source says whose retention it is when not the caller's own flag ("published
	// by apiserver a"); it follows the flag in the refusal.
	Source string
	// Ledger reads the cluster's key ledger (keyledger.Store.Load).
	Ledger func(ctx context.Context) (*keyledger.Ledger, error)
	// Override lets a refused change through (logged), as for every guard.
	Override func() bool
	Clock    clock.PassiveClock
	Logger   klog.Logger
}

// check refuses dropping from current (its keys) to next what the ledger holds.
func (o RetentionOptions) check(ctx context.Context, current []transformers.Entry[transformers.KeyInfo], next *config.Config) error {
	if o.Retention <= 0 || o.Ledger == nil {
		return nil
	}
	c := o.Clock
	if c == nil {
		c = clock.RealClock{}
	}
	nextKeys := ConfigKeys(next)
	if len(DroppedKeys(current, nextKeys)) == 0 {
		return nil // nothing dropped: no etcd read
	}
	l, err := o.Ledger(ctx)
	if err != nil {
		return fmt.Errorf("cannot check --%s: %w; retry, or set --%s=0 to drop keys without it", BackupRetentionFlag, err, BackupRetentionFlag)
	}
	holds := CheckRetention(l, current, nextKeys, o.Retention, c.Now())
	if len(holds) == 0 {
		return nil
	}
	for i := range holds {
		holds[i].Source = o.Source
	}
	gerr := &RefusedError{Check: Retention, Next: ConfigName(next), Holds: holds}
	if o.Override != nil && o.Override() {
		logger := o.Logger
		if logger.GetSink() == nil {
			logger = klog.Background()
		}
		logger.Info("Dropping keys a backup within the retention may need, because the override is set", "config", next.Source, "hash", next.Hash, "detail", gerr.Error())
		return nil
	}
	return gerr
}

// NewRetention returns a reload guard (reload.Options.Guard, after New's) that refuses
// a configuration dropping a key a snapshot within o.Retention may need.
func NewRetention(o RetentionOptions) func(current, next *config.Config) error {
	return func(current, next *config.Config) error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		return o.check(ctx, ConfigKeys(current), next)
	}
}

// CheckRetentionChange is the CLI's check (rekey rotate --remove-old, check-config):
// current to next against the ledger.
func CheckRetentionChange(ctx context.Context, o RetentionOptions, current, next *config.Config) error {
	return o.check(ctx, ConfigKeys(current), next)
}
