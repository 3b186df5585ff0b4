// Package migrate keeps stored data on the current keys: it takes inventories of which
// provider and key encrypt every stored object, re-encrypts stale objects in etcd with
// compare-and-swap, and guards configuration changes so that a key still in use is never
// dropped.
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
// feed the guard that the agent runs before every reload:
//
//	store := &migrate.InventoryStore{}
//	m, _ := migrate.NewMetrics(registry)
//	agentOpts.Guard = migrate.NewGuard(store, func() bool { return overrideFlag }, m, logger)
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
//
// # Guard
//
// CheckChange / NewGuard refuse a configuration that cannot read a (resource, provider,
// key) the latest inventory counts objects under, that drops the current write key in
// one step, or that drops a key of a resource no up-to-date inventory covers. The
// refusal names the resource, key and object count; OverrideFlag lets it through for
// disaster recovery. They judge every resource whose lookup chain may change: the
// rules of both configurations (wildcards as pseudo-resources) and the inventory's.
//
// NewDecryptGuard (reload.Options.SetGuard) proves, on the built Set, that a KMS v2
// provider that kept its name still decrypts one stored DEK per key id.
//
// The guards compare configurations in memory; CheckStartup closes the way around them
// through a restart. An AppliedState (key fingerprints, never keys) of every applied
// configuration is kept in etcd (EtcdAppliedState, AppliedStatePrefix + apiserver id)
// or a file, and before serving the configuration on disk is checked against it:
//
//	state := migrate.EtcdAppliedState{Client: etcdClient, Key: migrate.AppliedStatePrefix + apiserverID}
//	err := migrate.CheckStartup(ctx, migrate.StartupOptions{State: state, Config: agent.ActiveConfig(),
//		Client: etcdClient, Source: migrate.FromRules(agent, agent.Rules), Resources: resources,
//		Transformers: agent, Override: overrideFlag, Inventory: store})
//	agentOpts.Applied = func(cfg *config.Config) { _ = state.Save(ctx, migrate.NewAppliedState(cfg, store.Latest(), time.Now())) }
package migrate
