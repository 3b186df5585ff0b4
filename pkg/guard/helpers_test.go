package guard

import (
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"

	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

var (
	secrets    = schema.GroupResource{Resource: "secrets"}
	configmaps = schema.GroupResource{Resource: "configmaps"}
)

func testResources() []migrate.Resource {
	return []migrate.Resource{migrate.ResourceFor(migrate.DefaultEtcdPrefix, secrets), migrate.ResourceFor(migrate.DefaultEtcdPrefix, configmaps)}
}

// writeObjects stores n objects of gr under its default etcd key prefix, encrypted
// with set.
func writeObjects(t testing.TB, cli *clientv3.Client, set *transformers.Set, gr schema.GroupResource, n int) []string {
	t.Helper()
	return enctest.WriteObjects(t, cli, set, gr, migrate.ResourceFor(migrate.DefaultEtcdPrefix, gr).KeyPrefix, n)
}

// setFor is a one-rule configuration for resources and its Set.
func setFor(t testing.TB, resources string, providers ...string) (*config.Config, *transformers.Set) {
	t.Helper()
	cfg := enctest.MustConfig(t, enctest.ConfigYAML(resources, providers...))
	return cfg, enctest.MustSet(t, cfg)
}

func startEtcd(t testing.TB) *clientv3.Client {
	t.Helper()
	return etcdtest.Start(t).Client(t)
}

func testLogger(t testing.TB) klog.Logger { return ktesting.NewLogger(t, ktesting.NewConfig()) }
