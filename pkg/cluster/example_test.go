package cluster_test

import (
	"context"
	"fmt"
	"net/http"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

// A binary wires one Node per apiserver: the node first (its member list must be
// loaded before the agent applies its first configuration), then the agent with the
// node's hooks, then Attach. It needs the apiservers' etcd, so it is compiled here but
// not run; pkg/layer wires it the same way for the shim and kube-apiserver.
func ExampleNode() {
	ctx := context.Background()
	etcd, err := clientv3.New(clientv3.Config{Endpoints: []string{"http://127.0.0.1:2379"}, DialTimeout: 5 * time.Second})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer etcd.Close()

	node, err := cluster.New(cluster.Options{Client: etcd, ID: "host-a:6443", ResourcePrefix: "/registry"})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := node.Start(ctx); err != nil { // lists the members, then watches them
		fmt.Println(err)
		return
	}
	defer node.Close() // revokes the member lease: the others stop counting this one at once

	agent, err := reload.NewAgent(ctx, reload.Options{
		Path: "/etc/kubernetes/encryption.yaml", AutomaticReload: true,
		WriteFence: node.WriteFence, OnChange: node.Notify, Guard: node.Guard,
		Transformers: transformers.Options{KMS: kmsv2.NewFactory(kmsv2.FactoryOptions{
			// A plugin's new key id is published at once, and written under only once
			// every other apiserver's plugin reports it.
			OnKeyIDChange: node.NotifyKeyID, MayWriteKeyID: node.MayWriteKeyID,
		})},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	node.Attach(agent) // publishing starts

	// /readyz fails on a straggler; the status document carries node.Status().
	ready := node.ReadyzCheck()
	fmt.Println(ready.Name(), ready.Check(&http.Request{}), node.Status().Verdict.Summary)
}

// `rekey status` judges the cluster from a snapshot of the member records (what
// ReadSnapshot returns): here apiserver a's fence holds its new write key k2 back
// because b cannot read it yet, so the cluster has not converged.
func ExampleEvaluate() {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	// Check values as transformers.CheckValue makes them from the secrets.
	k1 := cluster.Key{Provider: transformers.ProviderAESGCM, Key: "k1", Check: "5be0d8f8a1c7e2b3"}
	k2 := cluster.Key{Provider: transformers.ProviderAESGCM, Key: "k2", Check: "09e4c6d1f2a37b58"}
	a := cluster.MemberState{APIServerID: "a", Resources: []cluster.ResourceState{
		{Resource: "secrets", Write: k1, Read: []cluster.Key{k2, k1}, Held: &k2, HeldSince: now.Add(-time.Minute)},
	}}
	b := cluster.MemberState{APIServerID: "b", Resources: []cluster.ResourceState{
		{Resource: "secrets", Write: k1, Read: []cluster.Key{k1}},
	}}

	v := cluster.Evaluate([]cluster.MemberState{a, b}, nil, now, cluster.DefaultDisagreementAlarm)
	fmt.Println(v.Converged, v.Summary)

	b.Resources[0].Read = []cluster.Key{k1, k2}
	a.Resources[0].Write, a.Resources[0].Held = k2, nil
	b.Resources[0].Write = k2
	v = cluster.Evaluate([]cluster.MemberState{a, b}, nil, now, cluster.DefaultDisagreementAlarm)
	fmt.Println(v.Converged, v.Summary)
	// Output:
	// false promoting aesgcm/k2 for secrets on a, waiting for b
	// true converged
}
