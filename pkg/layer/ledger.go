package layer

import (
	"context"
	"time"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/keyledger"
)

// ledgerRecordInterval is how often a member folds what it writes with and its latest
// inventory into the key ledger; the ledger itself writes "last use" at most every
// keyledger.DefaultTouchInterval, so most records write nothing.
const ledgerRecordInterval = time.Minute

// ledgerStore is the cluster's key ledger, under the coordination prefix.
func (l *Layer) ledgerStore() keyledger.Store {
	return keyledger.Store{Client: l.client, Key: keyledger.Key(l.opts.coordinationPrefix())}
}

// ledgerRecorder records this member's write keys (the agent's running rules: a write
// fence may hold the configuration's first key back) and retirements its inventories
// show.
func (l *Layer) ledgerRecorder() *keyledger.Recorder {
	return &keyledger.Recorder{Store: l.ledgerStore(), Rules: l.agent.Rules, Inventory: l.store.Latest, Retention: l.largestRetention, Logger: l.log,
		Wake: l.ledgerWake,
		Seen: func(led *keyledger.Ledger) {
			l.ledger.Store(led)
			m := led.SupersededKMSKeyIDs()
			l.superseded.Store(&m)
		}}
}

// ledgerReadTimeout bounds the key ledger read at start (loadSuperseded).
const ledgerReadTimeout = 3 * time.Second

// loadSuperseded reads the key ledger's superseded KMS v2 key ids once, before the KMS
// providers start. Without it they still refuse the key ids they rotated away from
// themselves, and the recorder hands the ledger over at its first record.
func (l *Layer) loadSuperseded(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, ledgerReadTimeout)
	defer cancel()
	led, _, _, err := l.ledgerStore().Load(ctx)
	if err != nil {
		l.log.Error(err, "Could not read the key ledger at start; KMS v2 key id reuses known to it are recognised from its first record on")
		return
	}
	m := led.SupersededKMSKeyIDs()
	l.superseded.Store(&m)
}

// wakeLedger asks the ledger recorder to record now; it never blocks (a KMS provider's
// loop calls it).
func (l *Layer) wakeLedger() {
	select {
	case l.ledgerWake <- struct{}{}:
	default:
	}
}

// supersededKeyIDs is kmsv2.FactoryOptions.SupersededKeyIDs: the key ledger's, as last
// read. It never blocks (the providers ask it before every Status).
func (l *Layer) supersededKeyIDs(provider string) []string {
	if m := l.superseded.Load(); m != nil {
		return (*m)[provider]
	}
	return nil
}

// largestRetention is the largest --backup-retention the live members publish (this
// one's included), known when every one of them publishes it: the key ledger keeps
// what it covers. Without cluster coordination the other apiservers do not say.
func (l *Layer) largestRetention() (time.Duration, bool) {
	if l.node == nil {
		return l.opts.BackupRetention, false
	}
	longest, _, unknown := cluster.LargestRetention(l.node.Members())
	return max(longest, l.opts.BackupRetention), len(unknown) == 0
}

// retentionOptions are the backup-retention guard's, on reload and at start.
func (l *Layer) retentionOptions() guard.RetentionOptions {
	store, allow := l.ledgerStore(), l.opts.AllowDroppingKeysInUse
	return guard.RetentionOptions{
		Retention: l.opts.BackupRetention,
		Ledger: func(ctx context.Context) (*keyledger.Ledger, error) {
			led, _, _, err := store.Load(ctx)
			return led, err
		},
		Override: func() bool { return allow },
		Logger:   l.log,
	}
}
