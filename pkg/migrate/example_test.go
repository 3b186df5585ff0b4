package migrate_test

import (
	"context"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Migrate rewrites every secret that is not stored with the configuration's write key,
// then re-scans to prove none is left. It needs a running etcd, so this example is
// compiled but not run; the package's tests run the same calls against embedded etcd.
func ExampleMigrate() {
	ctx := context.Background()
	cfg, err := config.Load("/etc/kubernetes/encryption.yaml", config.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	set, err := transformers.Build(ctx, cfg, transformers.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer set.Close()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{"http://127.0.0.1:2379"}})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer cli.Close()

	res, err := migrate.Migrate(ctx, migrate.Options{
		Client:         cli,
		Source:         migrate.FromSet(set),
		Resources:      []migrate.Resource{migrate.ResourceFor("/registry", schema.GroupResource{Resource: "secrets"})},
		Rate:           2000, // objects per second
		CheckpointPath: "/var/lib/rekey/migration.json",
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%d objects rewritten in %d passes\n", res.Rewritten, res.Passes)
}
