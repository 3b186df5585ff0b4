// Package keyledger remembers, in etcd, every key and KMS key id the cluster ever wrote
// with, so that a backup taken before a rotation stays restorable: a key that leaves
// the configuration is otherwise forgotten, and nothing says which keys an etcd
// snapshot needs.
//
// The ledger is one etcd key under the coordination prefix (Key), a JSON document of
// Entry values: provider, name, check value (transformers.CheckValue; for KMS v2 the
// "sha256:" key id hash), never key material, with the first and last use, the last
// time an inventory counted objects under it, and its retirement. Every event carries
// the etcd revision it was observed at: members compare revisions, never clocks.
//
// Ledger.Observe is pure (no I/O, an injected time and revision); Store does the
// compare-and-swap, and Recorder is the driver a member runs:
//
//	rec := &keyledger.Recorder{Store: keyledger.Store{Client: cli, Key: keyledger.Key("/rekey")},
//		Member: "apiserver-1", Rules: agent.Rules, Inventory: store.Latest}
//	go rec.Run(ctx, time.Minute)
//
// A key retires when it is written by nobody and an inventory taken after its last
// recorded write finds no object under it: from then on, only snapshots older than the
// retirement may hold values under it. pkg/guard refuses to drop a key retired less than
// --backup-retention ago; a snapshot file carries its own ledger, which `rekey inventory
// --snapshot` reads to tell keys of one name apart.
//
// The ledger is bounded without forgetting what a backup may need. Each member publishes
// its --backup-retention in its member record, and the Recorder passes the largest
// (Observation.Retention; unknown while a member does not say) to Observe, which:
//
//   - folds the key ids of a KMS v2 provider beyond MaxKMSKeyIDs into one history entry
//     of the provider (Entry.EarlierKeyIDs): the guard looks a KMS v2 provider up by
//     name, so the history holds it as long as its latest key id needs it, and a plugin
//     whose key id changes hourly cannot crowd out local keys;
//   - beyond MaxEntries, forgets only entries retired longer ago than that retention;
//   - beyond MaxHeldEntries, forgets the oldest entries anyway and records the latest
//     retirement it forgot (Ledger.Forgotten): the guard then refuses to drop a key the
//     ledger does not know while a snapshot within the retention may need one it forgot.
package keyledger
