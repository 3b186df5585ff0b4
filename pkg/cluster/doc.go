// Package cluster makes many apiservers, each with its own copy of the encryption
// configuration, act as one: none starts writing with a key another live apiserver
// cannot read, and stored data is migrated once, by one elected apiserver, after all of
// them write with the same key. The apiservers' own etcd is the coordination engine
// (leases, a watch, an election, transactions); docs/cluster.md describes the keys.
//
//   - Each apiserver publishes a MemberState (write and read keys per resource, KMS
//     key id hashes, health, config hash) under a lease at <prefix>/members/<id>.
//   - A Node watches the members (Node.Members); an expired lease drops a member out.
//     Each list and watch response is stepped into the fence as it arrives; the
//     queries below only ask it, and what a decision changed comes back with it.
//   - Its write fence, a pure state machine inside the package, tells the reload.Agent
//     which chain entry writes (Node.WriteFence): a new write key is held back, the
//     previous one writing, until every live member can read it, and then promoted
//     without a new file. Status.Holds lists what it holds back.
//   - The same fence answers for KMS v2 key ids (Node.MayWriteKeyID, for
//     kmsv2.FactoryOptions): a provider whose plugin reports a new key id keeps writing
//     under the old one until every other live member's plugin reports the new one.
//   - A disagreement alarm, fed the fence's events, is raised when the members have
//     disagreed about a write key for longer than Options.DisagreementAlarm; Evaluate
//     sums the cluster up for `rekey status` (ExampleEvaluate), from a Node's Status
//     or from ReadSnapshot.
//   - A Migrator runs storage migration on the apiserver elected at
//     <prefix>/migration/leader, with the checkpoint in etcd; what to migrate, and
//     when, is decided by another pure state machine inside the package.
//   - ReadyzCheck fails on a straggler; Guard refuses dropping keys still needed.
//
// pkg/reload does not import this package; a Node plugs into its hooks (ExampleNode):
//
//	node, err := cluster.New(cluster.Options{Client: etcd, ID: "host-a:6443", ResourcePrefix: "/registry"})
//	if err != nil { ... }
//	if err := node.Start(ctx); err != nil { ... }  // loads the member list first
//	defer node.Close()                            // revokes the member lease
//	agent, err := reload.NewAgent(ctx, reload.Options{
//		Path: path, AutomaticReload: true,
//		WriteFence: node.WriteFence, OnChange: node.Notify, Guard: node.Guard,
//	})
//	node.Attach(agent)                            // publishing starts
//	serverConfig.AddReadyzChecks(node.ReadyzCheck())
package cluster
