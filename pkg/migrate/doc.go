// Package migrate keeps stored data on the current keys: it takes inventories of which
// provider and key encrypt every stored object, and rewrites stale objects in etcd
// with compare-and-swap. Refusing a configuration that drops a key still in use is
// pkg/guard's job; its checks count stored objects with this package's inventories.
//
// # Inventory
//
// TakeInventory pages through each resource's etcd key range at one revision and
// tallies every object per bucket: provider, key (aes/secretbox key name, or KMS v2
// provider name and "sha256:" hash of the key id read from the stored EncryptedObject,
// no plugin call) and state (current or stale), plus plaintext, unreadable and
// acknowledged objects; DecryptCheck also decrypts every value. Memory is bounded by
// one page and by the buckets kept per resource. A Resolver turns the configuration's
// rules, wildcards included, into the resources stored now; an InventoryStore holds
// the latest inventory for the guard, the status document and the metrics.
//
// # Migration
//
// Migrate rewrites every stale object through the current transformers: read at
// ModRevision R, decrypt, encrypt with the write key, and commit only if the object is
// still at R (batched: one transaction per up to DefaultBatchSize objects; when any of
// them changed, the failed transaction reads the batch back and the batch is tried
// again with the changed objects prepared anew). A concurrent update always wins; the
// object is then rewritten from its new value only if that is still stale. Every transaction goes
// through a pace.Writer (pkg/migrate/pace), which keeps etcd's database below its
// quota and adapts the rate to etcd's latency and, inside an apiserver, to the
// apiserver's clients and watch cache. Progress is checkpointed (at most every
// 250 ms, and whenever a resource ends or the run stops) to the file at
// Options.CheckpointPath or to an Options.Checkpoints store (pkg/cluster keeps it in
// etcd), so a stopped run resumes after the last recorded page. A run returns nil only
// after a re-scan with a decrypt check finds no stale and no unacknowledged unreadable
// object.
//
//	res, err := migrate.Migrate(ctx, migrate.Options{
//		Client:         etcdClient,
//		Source:         migrate.FromSet(set),
//		Resources:      []migrate.Resource{migrate.ResourceFor(migrate.DefaultEtcdPrefix, schema.GroupResource{Resource: "secrets"})},
//		Rate:           2000,
//		CheckpointPath: "/var/lib/rekey/migration.json",
//	})
//
// # Unreadable objects
//
// An object no configured key can read is left unchanged and listed by the
// inventory. An Acknowledger (rekey migrate --acknowledge-unreadable) records, under
// the coordination prefix in etcd, that an operator knows of one, lists the records
// and removes them; an acknowledged object no longer keeps a migration unverified or
// a key in use, until its stored value changes. Inventories read the records in force
// and delete the void ones.
//
// # Inside an apiserver
//
// A Controller (pkg/layer starts one) watches each resource's write key through the
// reload agent (Source: FromRules), takes inventories, and, with AutoMigrate,
// migrates a resource when its write key changes; its Status feeds the "storage" part
// of the agent's status document. With coordination, pkg/cluster's migrator on the
// elected apiserver runs the migrations instead, and each controller only keeps its
// local inventory current.
package migrate
