package layer

import (
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/migrate/pace"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

func TestFlagsValidate(t *testing.T) {
	kube, shim := KubeAPIServerDefaults(), ShimDefaults()
	// Both binaries migrate by default; the refusal below is for a binary where
	// migration is opt-in.
	optIn := kube
	optIn.StorageMigration = false
	for _, tc := range []struct {
		name     string
		defaults Defaults
		change   func(*Flags)
		want     string
	}{
		{"kube-apiserver defaults", kube, func(*Flags) {}, ""},
		{"shim defaults", shim, func(*Flags) {}, ""},
		{"unknown layer", kube, func(f *Flags) { f.EncryptionLayer = "other" }, `--encryption-layer="other"`},
		{"empty layer", kube, func(f *Flags) { f.EncryptionLayer = "" }, `--encryption-layer=""`},
		{"migration asked for on upstream's layer", optIn, func(f *Flags) { f.EncryptionLayer, f.StorageMigration = EncryptionLayerUpstream, true }, "--storage-migration needs --encryption-layer=rekey"},
		// Migration on by default; upstream's layer runs without it.
		{"default migration on upstream's layer", shim, func(f *Flags) { f.EncryptionLayer = EncryptionLayerUpstream }, ""},
		{"default migration on upstream's layer (kube-apiserver)", kube, func(f *Flags) { f.EncryptionLayer = EncryptionLayerUpstream }, ""},
		{"negative rate", shim, func(f *Flags) { f.StorageMigrationRate = -1 }, "--storage-migration-rate"},
		{"wildcard resource", kube, func(f *Flags) { f.StorageResources = []string{"*.example.com"} }, "a wildcard rule's resources are found in etcd"},
		{"apiserver id with a slash", kube, func(f *Flags) { f.APIServerID = "node/a" }, "--apiserver-id"},
		{"no coordination, any id", kube, func(f *Flags) { f.ClusterCoordination, f.APIServerID = false, "node/a" }, ""},
		{"negative seed age", kube, func(f *Flags) { f.KMSSeedMaxAge = -time.Hour }, "--kms-seed-max-age"},
		{"negative seed writes", kube, func(f *Flags) { f.KMSSeedMaxWrites = -1 }, "--kms-seed-max-writes"},
		{"negative DEK idle", kube, func(f *Flags) { f.KMSDEKCacheIdle = -time.Hour }, "--kms-dek-cache-idle"},
		{"negative key id confirmations", kube, func(f *Flags) { f.KMSKeyIDConfirmations = -1 }, "--kms-key-id-confirmations"},
		{"key id acts at once", kube, func(f *Flags) { f.KMSKeyIDConfirmations = 1 }, ""},
		{"no seed bounds", kube, func(f *Flags) { f.KMSSeedMaxAge, f.KMSSeedMaxWrites, f.KMSDEKCacheIdle = 0, 0, 0 }, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := NewFlags(tc.defaults)
			tc.change(&f)
			errs := f.Validate()
			switch {
			case tc.want == "" && len(errs) > 0:
				t.Fatalf("unexpected errors: %v", errs)
			case tc.want != "" && (len(errs) != 1 || !strings.Contains(errs[0].Error(), tc.want)):
				t.Fatalf("errors %v, want one containing %q", errs, tc.want)
			}
		})
	}
}

// Options read the flags as they are; the defaults of --apiserver-id and
// --encryption-state-id are the binary's identity; resources are the binary's and
// those the flag names, under --etcd-prefix.
func TestOptionsFromFlags(t *testing.T) {
	base := func(f Flags) Options {
		return Options{Flags: f, Path: "enc.yaml", EtcdPrefix: "/kube", Identity: "apiserver-abc",
			Resources: []migrate.Resource{{KeyPrefix: "/kube/fixed/"}}}
	}

	f := NewFlags(KubeAPIServerDefaults())
	fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
	f.AddFlags(fs)
	if err := fs.Parse([]string{"--storage-migration-resources=secrets,widgets.example.com", "--kms-write-ttl=1m", "--storage-migration"}); err != nil {
		t.Fatal(err)
	}
	o := base(f)
	o.Resources = nil // kube-apiserver names none of its own
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	if o.stateID() != "apiserver-abc" || o.memberID() != "apiserver-abc" {
		t.Errorf("state id %q, member id %q: want the binary's identity by default", o.stateID(), o.memberID())
	}
	rs, err := o.resources()
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 2 || rs[0].KeyPrefix != "/kube/secrets/" || rs[1].KeyPrefix != "/kube/example.com/widgets/" {
		t.Errorf("resources %+v: want the flag's, under --etcd-prefix", rs)
	}
	if !o.StorageMigration || o.KMSWriteTTL != time.Minute || o.KMSStatusInterval != DefaultKMSStatusInterval ||
		!o.ClusterCoordination || o.coordinationPrefix() != "/rekey-kube" || o.ClusterLeaseTTL != cluster.DefaultLeaseTTL {
		t.Errorf("options %+v do not carry the flags", o)
	}

	s := NewFlags(ShimDefaults())
	s.APIServerID, s.EncryptionStateID = "host:6443", "state-1"
	o = base(s)
	if o.stateID() != "state-1" || o.memberID() != "host:6443" || o.Identity != "apiserver-abc" {
		t.Errorf("state id %q, member id %q, identity %q", o.stateID(), o.memberID(), o.Identity)
	}
	if rs, err := o.resources(); err != nil || len(rs) != 1 || rs[0].KeyPrefix != "/kube/fixed/" {
		t.Errorf("resources %+v, %v: want the binary's own where it offers no flag", rs, err)
	}
}

// The seed-lifetime flags default to kmsv2's figures; a flag's 0 ("no bound") reaches
// kmsv2 as a negative value, since kmsv2's zero keeps its default.
func TestKMSSeedLifetimeFlags(t *testing.T) {
	f := NewFlags(KubeAPIServerDefaults())
	fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
	f.AddFlags(fs)
	if f.KMSSeedMaxAge != kmsv2.DefaultSeedMaxAge || f.KMSSeedMaxWrites != kmsv2.DefaultSeedMaxWrites || f.KMSDEKCacheIdle != kmsv2.DefaultDEKCacheIdle {
		t.Errorf("defaults: age %s, writes %d, idle %s", f.KMSSeedMaxAge, f.KMSSeedMaxWrites, f.KMSDEKCacheIdle)
	}
	if noBoundIfZero(f.KMSSeedMaxAge) != kmsv2.DefaultSeedMaxAge || noBoundIfZero(f.KMSSeedMaxWrites) != kmsv2.DefaultSeedMaxWrites {
		t.Error("a bound other than 0 must reach kmsv2 as it is")
	}
	if err := fs.Parse([]string{"--kms-seed-max-age=0", "--kms-seed-max-writes=1000", "--kms-dek-cache-idle=0"}); err != nil {
		t.Fatal(err)
	}
	if noBoundIfZero(f.KMSSeedMaxAge) >= 0 || noBoundIfZero(f.KMSSeedMaxWrites) != 1000 || noBoundIfZero(f.KMSDEKCacheIdle) >= 0 {
		t.Errorf("0 must mean no bound: age %s, writes %d, idle %s", f.KMSSeedMaxAge, f.KMSSeedMaxWrites, f.KMSDEKCacheIdle)
	}
}

// The default coordination prefix follows --etcd-prefix: /rekey for kube's /registry
// (where existing deployments keep their keys), a prefix of its own for any other, never
// nested under /rekey/ and always outside the resource prefix.
func TestDefaultCoordinationPrefix(t *testing.T) {
	for etcdPrefix, want := range map[string]string{
		"":              "/rekey",
		"/registry":     "/rekey",
		"/registry/":    "/rekey",
		"registry":      "/rekey",
		"/kube":         "/rekey-kube",
		"/k8s/team-a/":  "/rekey-k8s/team-a",
		"/members":      "/rekey-members",
		"/rekey":        "/rekey-rekey",
		"/rekey-kube":   "/rekey-rekey-kube",
		"/rekey/nested": "/rekey-rekey/nested",
	} {
		got := DefaultCoordinationPrefix(etcdPrefix)
		if got != want {
			t.Errorf("DefaultCoordinationPrefix(%q) = %q, want %q", etcdPrefix, got, want)
		}
		if err := coordination.ValidatePrefix(got, etcdPrefix); etcdPrefix != "" && err != nil {
			t.Errorf("DefaultCoordinationPrefix(%q) = %q: %v", etcdPrefix, got, err)
		}
	}
	// Options without a coordination prefix take the default, applied state included.
	o := Options{Flags: Flags{ClusterCoordination: true, APIServerID: "a"}, Path: "enc.yaml", EtcdPrefix: "/kube"}
	if err := o.Validate(); err != nil || o.coordinationPrefix() != "/rekey-kube" {
		t.Errorf("Options with --etcd-prefix /kube: prefix %q, %v", o.coordinationPrefix(), err)
	}
	o.CoordinationPrefix = "/kube/rekey"
	if err := o.Validate(); err == nil {
		t.Error("a coordination prefix inside --etcd-prefix passed Validate")
	}
}

// --storage-migration-priority picks the clients' latency factor unless
// --storage-migration-client-latency-factor is given, even at its default value; the
// layer's pacing options carry both.
func TestStorageMigrationPriority(t *testing.T) {
	for _, tc := range []struct {
		args         []string
		wantFactor   float64 // what the layer passes pace (0: the priority's)
		wantPriority pace.Priority
		effective    float64
	}{
		{nil, 0, pace.PriorityNormal, 1.5},
		{[]string{"--storage-migration-priority=gentle"}, 0, pace.PriorityGentle, 1.5},
		{[]string{"--storage-migration-priority=fast"}, 0, pace.PriorityFast, 3},
		{[]string{"--storage-migration-priority=fast", "--storage-migration-client-latency-factor=1.5"}, 1.5, pace.PriorityFast, 1.5},
		{[]string{"--storage-migration-client-latency-factor=2", "--storage-migration-priority=gentle"}, 2, pace.PriorityGentle, 2},
	} {
		f := NewFlags(KubeAPIServerDefaults())
		fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
		f.AddFlags(fs)
		if err := fs.Parse(tc.args); err != nil {
			t.Fatal(err)
		}
		if errs := f.Validate(); len(errs) > 0 {
			t.Fatalf("%q: %v", tc.args, errs)
		}
		l := &Layer{opts: Options{Flags: f}}
		p := l.pacing()
		effective := p.ServingFactor
		if effective == 0 {
			effective = p.Priority.ServingFactor()
		}
		if p.ServingFactor != tc.wantFactor || p.Priority != tc.wantPriority || effective != tc.effective {
			t.Errorf("%q: pacing factor %v, priority %q (effective factor %v), want %v, %q (%v)",
				tc.args, p.ServingFactor, p.Priority, effective, tc.wantFactor, tc.wantPriority, tc.effective)
		}
	}

	// In process, a factor other than the default is explicit too.
	f := NewFlags(ShimDefaults())
	f.StorageMigrationPriority, f.StorageMigrationClientLatencyFactor = "fast", 1.2
	if factor, priority := f.Pacing(); factor != 1.2 || priority != pace.PriorityFast {
		t.Errorf("in process: factor %v, priority %q, want 1.2, fast", factor, priority)
	}

	f = NewFlags(ShimDefaults())
	f.StorageMigrationPriority = "urgent"
	if errs := f.Validate(); len(errs) != 1 || !strings.Contains(errs[0].Error(), `--storage-migration-priority="urgent": must be gentle, normal or fast`) {
		t.Errorf("errors %v, want one naming the flag and its values", errs)
	}
}
