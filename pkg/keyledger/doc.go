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
package keyledger
