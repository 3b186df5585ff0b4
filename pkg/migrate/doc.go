// Package migrate keeps stored data on the current keys: it takes inventories of which
// provider and key encrypt every stored object, re-encrypts stale objects in etcd with
// compare-and-swap, and checkpoints its progress. Refusing a configuration that drops a
// key still in use is pkg/guard's job; its checks count stored objects with this
// package's inventories.
//
// # Inventory
//
// TakeInventory scans each resource's etcd key range at one revision, page by page, and
// counts objects per provider, key (aes/secretbox key name, or KMS v2 provider name and
// "sha256:" hash of the key id read from the stored EncryptedObject — no plugin call) and
// state (current or stale), plus plaintext and unreadable objects; DecryptCheck also
// decrypts every value. Memory is bounded by one page.
//
// # Migration
//
// Migrate rewrites every stale object through the current transformers: read at
// ModRevision R, decrypt, encrypt with the write key, and commit only if the object is
// still at R (batched: one transaction per up to 64 objects, falling back to one per
// object when any of them changed). A concurrent update always wins; the object is then
// re-read and rewritten only if still stale. Progress is checkpointed to a file (at most
// every 250 ms, and whenever a resource ends or the run stops) so a stopped run resumes
// after the last recorded page, re-checking the few pages after it; it is idempotent; it is
// rate-limited; and it returns nil only after a re-scan with a decrypt check finds no
// stale and no unreadable object.
//
//	res, err := migrate.Migrate(ctx, migrate.Options{
//		Client:    etcdClient,
//		Source:    migrate.FromSet(set),
//		Resources: []migrate.Resource{migrate.ResourceFor("/registry", schema.GroupResource{Resource: "secrets"})},
//		Rate:      2000,
//		CheckpointPath: "/var/lib/rekey/migration.json",
//	})
//
// # Inside an apiserver (the shim)
//
// A Controller watches each resource's write key (prefix and KMS key id hash) through
// the reload agent and migrates a resource when its write key changes; its inventories
// feed pkg/guard's check, which the agent runs before every reload:
//
//	store := &migrate.InventoryStore{}
//	m, _ := migrate.NewMetrics(registry)
//	agentOpts.Guard = guard.New(store, func() bool { return overrideFlag }, runningRules, m, logger) // runningRules: the agent's Rules once it exists
//	agent, _ := reload.NewAgent(ctx, agentOpts)
//	ctrl := migrate.NewController(migrate.ControllerOptions{
//		Client: etcdClient, Source: migrate.FromRules(agent, agent.Rules), Resources: resources,
//		AutoMigrate: storageMigrationFlag, // --storage-migration
//		Inventory: store, Metrics: m,
//		ConfigHash: func() string { return agent.ActiveConfig().Hash },
//	})
//	go ctrl.Run(ctx)
//
// The guard is built before the agent and the controller needs the agent, so both share
// one InventoryStore. A migration of some resources merges its verifying re-scan into
// the store's latest inventory. internal/shim wires it this way, with the controller's
// Status under "storage" in the agent's status document (reload.Options.StatusExtras).
package migrate
