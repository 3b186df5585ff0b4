// Package guard refuses an encryption configuration that would drop a key still in
// use, wherever one can be dropped: on a node's reload, at an apiserver's start and in
// the cluster. Every refusal is a *RefusedError (its Check says which check refused),
// and errors.Is(err, ErrRefused) matches all of them; OverrideFlag lets one through for
// disaster recovery, logged. Metrics count the refusals of every check, the cluster
// guard's included (Metrics.Count), by check.
//
// # On reload
//
// CheckChange / New refuse a configuration that cannot read a (resource, provider, key)
// the latest inventory (pkg/migrate) counts objects under, that drops the current write
// key in one step, or that drops a key of a resource no up-to-date inventory covers.
// The refusal names the resource, key and object count. They judge every resource
// whose lookup chain may change: the rules of both configurations (wildcards as
// pseudo-resources) and the inventory's.
//
// CheckDecrypt / NewDecrypt (reload.Options.SetGuard) prove, on the built Set, that a
// KMS v2 provider that kept its name still decrypts one stored DEK per key id.
//
//	store := &migrate.InventoryStore{}
//	m, err := guard.NewMetrics(registry) // the refusals, by check
//	agentOpts.Guard = guard.New(store, func() bool { return overrideFlag }, runningRules, m, logger) // runningRules: the agent's Rules once it exists
//	agentOpts.SetGuard = guard.NewDecrypt(guard.DecryptOptions{Inventory: store, Client: client, Metrics: m})
//
// # At start
//
// The checks above compare configurations in memory; CheckStartup closes the way
// around them through a restart. An AppliedState (key fingerprints, never keys) of
// every applied configuration is kept in etcd (EtcdAppliedState, at
// coordination.AppliedState under the coordination prefix) or a file
// (FileAppliedState), and before serving the configuration on disk is checked against
// it (CheckApplied, then CheckDecrypt):
//
//	state := guard.EtcdAppliedState{Client: etcdClient, Key: coordination.AppliedState("/rekey", apiserverID),
//		Fallback: guard.AppliedStatePrefix + apiserverID}
//	err := guard.CheckStartup(ctx, guard.StartupOptions{State: state, Config: agent.ActiveConfig(),
//		Client: etcdClient, Source: migrate.FromRules(agent, agent.Rules), Resources: resources,
//		Transformers: agent, Override: overrideFlag, Inventory: store})
//	agentOpts.Applied = func(cfg *config.Config) { _ = state.Save(ctx, guard.NewAppliedState(cfg, store.Latest(), time.Now())) }
//
// # Backups
//
// With --backup-retention D (default 0: off, so that clusters without etcd backups are
// never held back), NewRetention (reload), StartupOptions.Retention (start) and
// CheckRetentionChange (the CLI) refuse to drop a key that pkg/keyledger says retired
// less than D ago, or never retired: an etcd snapshot kept that long may hold values
// under it (Check Retention).
//
// # In the cluster
//
// pkg/cluster's guard refuses to drop a key another apiserver writes with or the
// cluster's migration still needs, with the same *RefusedError (Check Cluster).
package guard
