// Package pace keeps a storage migration from hurting the cluster it migrates. A
// migration shares etcd and the control plane's CPUs with the cluster's own traffic;
// every etcd transaction of pkg/migrate goes through a Writer, which holds it until
// two things allow it:
//
//   - the space gate: every rewrite adds an etcd revision that stays until
//     compaction, so the migration reads etcd's database size and alarms and pauses
//     before the database reaches SpaceOptions.MaxFraction of the quota, resuming
//     when compaction has freed room (PauseState says why it waits);
//   - the pacer: an AIMD rate (additive increase, multiplicative decrease) judged once
//     per window on the latency and errors of the migration's own transactions and,
//     inside an apiserver, on two signals of its own: how fast it answers its clients
//     (ServingLatency: each RequestClass against its own baseline, taken while no
//     migration wrote) and how far its watch cache of the resource is behind the
//     migration's writes (WatchCacheRevision).
//
// A Writer's ReadPacer paces a migration's verifying re-scan by the same clients'
// latency. The decisions themselves (the pacer, the space gate, the watch-lag record)
// read no clock and do no I/O: the Writer feeds them, and the transcripts in testdata
// tell their stories.
//
// Options and SpaceOptions are zero-value usable (the defaults); pkg/layer turns its
// --storage-migration-* flags into them, and pkg/migrate's Options carry them.
package pace
