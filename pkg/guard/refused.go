package guard

import (
	"errors"
	"fmt"
	"strings"

	"github.com/rekey-io/rekey/pkg/config"
)

// OverrideFlag is the flag of the apiserver shim and the rekey CLI that lets a change
// through the guard anyway (disaster recovery: the data under the dropped key is
// already lost or deliberately abandoned).
const OverrideFlag = "unsafe-allow-dropping-keys-in-use"

// ErrRefused matches every *RefusedError with errors.Is, whichever check refused.
var ErrRefused = errors.New("configuration change refused by the key-in-use guard")

// Check names the check that refused a configuration. Each says what was found and
// what the operator can do about it in its own words.
type Check string

const (
	// Change: the next configuration cannot read stored objects the inventory counts,
	// or the current write key (CheckChange, New).
	Change Check = "change"
	// Startup: the configuration on disk cannot read what the last applied
	// configuration could (CheckStartup with CheckApplied).
	Startup Check = "start-up"
	// Decrypt: a KMS v2 provider that keeps its name cannot decrypt a stored sample
	// (CheckDecrypt, on reload through NewDecrypt or at start through CheckStartup).
	Decrypt Check = "decrypt"
	// Cluster: another apiserver writes with, or the cluster's migration still needs,
	// a key the configuration drops (pkg/cluster's guard).
	Cluster Check = "cluster"
	// Retention: the configuration drops a key that an etcd snapshot kept within
	// --backup-retention may need, per the key ledger (CheckRetention).
	Retention Check = "backup-retention"
)

// RefusedError is the one error every refusal to drop a key in use returns, on a
// node's reload, at start-up and in the cluster. errors.Is(err, ErrRefused) matches it.
type RefusedError struct {
	// Check is the check that refused.
	Check Check
	// Next is the refused configuration: source and hash.
	Next string
	// Applied (Startup) describes the last applied configuration the refused one was
	// compared with.
	Applied string
	// Violations (Change, Startup) are the stored objects next cannot read.
	Violations []Violation
	// Failures (Decrypt) are the KMS v2 buckets the new plugin did not decrypt.
	Failures []DecryptFailure
	// Reasons (Cluster) say which member or migration still needs a dropped key.
	Reasons []string
	// Holds (Retention) are the dropped keys a snapshot within the retention may need.
	Holds []RetentionHold
}

// Is makes errors.Is(err, ErrRefused) true.
func (e *RefusedError) Is(target error) bool { return target == ErrRefused }

func (e *RefusedError) Error() string {
	var b strings.Builder
	list := func(items []string) {
		for _, s := range items {
			b.WriteString("\n  - ")
			b.WriteString(s)
		}
	}
	switch e.Check {
	case Startup:
		fmt.Fprintf(&b, "refusing to start with encryption configuration %s: it cannot read data that the last applied configuration %s could read:", e.Next, e.Applied)
		list(texts(e.Violations))
		b.WriteString("\nRestore these keys in the configuration (as read keys, not first in their list), start, and let the migration rewrite the data before dropping them. To start anyway (the data under them becomes unreadable), pass --" + OverrideFlag + ".")
	case Decrypt:
		fmt.Fprintf(&b, "refusing encryption configuration %s: a kms provider that keeps its name does not decrypt the data stored under it:", e.Next)
		list(texts(e.Failures))
		b.WriteString("\nPoint the provider at a plugin whose keyring holds these key ids (or start the plugin if it is unavailable), or give the new plugin a new provider name and keep the old one as a read provider until `rekey migrate` has rewritten the data; the current configuration keeps serving. To apply it anyway (the data becomes unreadable), pass --" + OverrideFlag + ".")
	case Cluster:
		fmt.Fprintf(&b, "refusing encryption configuration %s: it drops keys the cluster still needs:", e.Next)
		list(e.Reasons)
		b.WriteString("\nKeep these keys as read keys until every apiserver writes with their successor and the cluster's storage migration to it is verified (`rekey status` shows both); the current configuration keeps serving.")
	case Retention:
		fmt.Fprintf(&b, "refusing encryption configuration %s: it drops keys an etcd snapshot kept within --%s may need to be restored:", e.Next, BackupRetentionFlag)
		list(texts(e.Holds))
		b.WriteString("\nKeep these keys as read keys until the dates given (`rekey ledger` lists every key the cluster wrote with and when it retired); the current configuration keeps serving. To drop them anyway (snapshots holding values under them cannot be restored with the new configuration), lower --" + BackupRetentionFlag + " or pass --" + OverrideFlag + ".")
	default:
		fmt.Fprintf(&b, "refusing encryption configuration %s: it cannot read data that is still stored:", e.Next)
		list(texts(e.Violations))
		b.WriteString("\nKeep these keys as read keys (not first in their list) until `rekey migrate` has rewritten the data and `rekey inventory` shows no object under them; the current configuration keeps serving. To drop them anyway (the data under them becomes unreadable), pass --" + OverrideFlag + ".")
	}
	return b.String()
}

// texts renders each item of a refusal's list.
func texts[T fmt.Stringer](items []T) []string {
	out := make([]string, len(items))
	for i, it := range items {
		out[i] = it.String()
	}
	return out
}

// ConfigName is how a refusal names cfg: its source, quoted, and its hash.
func ConfigName(cfg *config.Config) string { return fmt.Sprintf("%q (%s)", cfg.Source, cfg.Hash) }
