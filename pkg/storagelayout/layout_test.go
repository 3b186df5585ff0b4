package storagelayout

import (
	"context"
	"testing"

	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/rekey-io/rekey/internal/etcdtest"
)

func gr(s string) schema.GroupResource { return schema.ParseGroupResource(s) }

// The built-in groups are where kube-apiserver stores them, not where the custom
// resource convention would put them; a resource the layout does not know is a guess.
func TestLocate(t *testing.T) {
	l := Kube("/registry/")
	for _, c := range []struct {
		res, prefix string
		known       bool
	}{
		{"secrets", "/registry/secrets/", true},
		{"deployments.apps", "/registry/deployments/", true},
		{"deployments.extensions", "/registry/deployments/", true},
		{"nodes", "/registry/minions/", true},
		{"services", "/registry/services/specs/", true},
		{"endpoints", "/registry/services/endpoints/", true},
		{"ingresses.networking.k8s.io", "/registry/ingress/", true},
		{"events.events.k8s.io", "/registry/events/", true},
		{"apiservices.apiregistration.k8s.io", "/registry/apiregistration.k8s.io/apiservices/", true},
		{"widgets.example.com", "/registry/example.com/widgets/", false},
		{"gadgets", "/registry/gadgets/", false},
	} {
		got := l.Locate(gr(c.res))
		if got.KeyPrefix != c.prefix || got.Guessed == c.known {
			t.Errorf("Locate(%s) = %q known=%v, want %q known=%v", c.res, got.KeyPrefix, !got.Guessed, c.prefix, c.known)
		}
	}
	if got := Kube("").Locate(gr("deployments.apps")).KeyPrefix; got != "/deployments/" {
		t.Errorf("with an empty --etcd-prefix: %q", got)
	}
	if got := Kube("/custom/prefix").Locate(gr("nodes")).KeyPrefix; got != "/custom/prefix/minions/" {
		t.Errorf("with --etcd-prefix=/custom/prefix: %q", got)
	}
}

func TestOwner(t *testing.T) {
	l := Kube("/registry")
	if err := l.Add(gr("widgets.example.com"), "example.com/widgets"); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		key, res, prefix string
		known, ok        bool
	}{
		{"/registry/deployments/default/web", "deployments.apps", "/registry/deployments/", true, true},
		{"/registry/events/default/e1", "events", "/registry/events/", true, true},
		{"/registry/services/specs/default/kubernetes", "services", "/registry/services/specs/", true, true},
		{"/registry/services/endpoints/default/kubernetes", "endpoints", "/registry/services/endpoints/", true, true},
		{"/registry/minions/node1", "nodes", "/registry/minions/", true, true},
		{"/registry/example.com/widgets/ns/w1", "widgets.example.com", "/registry/example.com/widgets/", true, true},
		{"/registry/other.io/things/ns/t1", "things.other.io", "/registry/other.io/things/", false, true},
		{"/registry/gadgets/g1", "gadgets", "/registry/gadgets/", false, true},
		{"/registry/ranges/serviceips", "", "", false, false},
		{"/registry/masterleases/10.0.0.1", "", "", false, false},
		{"/registry/health", "", "", false, false},
		{"/other/secrets/a/b", "", "", false, false},
	} {
		got, ok := l.Owner(c.key)
		if ok != c.ok || got.String() != c.res || got.KeyPrefix != c.prefix || (ok && got.Guessed == c.known) {
			t.Errorf("Owner(%s) = %s %q known=%v ok=%v, want %s %q known=%v ok=%v", c.key, got, got.KeyPrefix, !got.Guessed, ok, c.res, c.prefix, c.known, c.ok)
		}
	}
	if err := l.AddKeyPrefix(gr("x.y.z"), "/elsewhere/x/"); err == nil {
		t.Error("a key prefix outside the etcd prefix was accepted")
	}
}

// The skip scan finds each stored resource once, with one request per resource, skips
// the untransformed directories and the coordination prefix, and learns custom
// resources from their stored definitions' keys.
func TestStoredAndCRDs(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	put := func(k string) {
		if _, err := cli.Put(ctx, k, "k8s:enc:aesgcm:v1:key1:opaque"); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < 50; i++ {
		put("/registry/secrets/ns/s" + string(rune('a'+i%26)) + string(rune('a'+i/26)))
	}
	put("/registry/deployments/ns/web")
	put("/registry/services/specs/default/kubernetes")
	put("/registry/services/endpoints/default/kubernetes")
	put("/registry/ranges/serviceips")
	put("/registry/masterleases/10.0.0.1")
	put("/registry/apiextensions.k8s.io/customresourcedefinitions/widgets.example.com")
	put("/registry/example.com/widgets/ns/w1")
	put("/registry/rekey/members/a")
	put("/registryx/secrets/ns/outside")

	l := Kube("/registry")
	if got := l.Locate(gr("widgets.example.com")); !got.Guessed {
		t.Fatal("a custom resource is known before its definition was read")
	}
	if err := l.AddStoredCRDs(ctx, cli); err != nil {
		t.Fatal(err)
	}
	if got := l.Locate(gr("widgets.example.com")); got.Guessed || got.KeyPrefix != "/registry/example.com/widgets/" {
		t.Fatalf("after AddStoredCRDs: %+v", got)
	}
	locs, rev, err := l.Stored(ctx, cli, "/registry/rekey")
	if err != nil {
		t.Fatal(err)
	}
	if rev == 0 {
		t.Error("no revision")
	}
	var got []string
	for _, loc := range locs {
		got = append(got, loc.String()+"="+loc.KeyPrefix)
		if loc.Guessed {
			t.Errorf("%s found at a prefix the layout does not know", loc)
		}
	}
	want := []string{
		"customresourcedefinitions.apiextensions.k8s.io=/registry/apiextensions.k8s.io/customresourcedefinitions/",
		"deployments.apps=/registry/deployments/",
		"widgets.example.com=/registry/example.com/widgets/",
		"secrets=/registry/secrets/",
		"endpoints=/registry/services/endpoints/",
		"services=/registry/services/specs/",
	}
	if len(got) != len(want) {
		t.Fatalf("Stored = %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("Stored = %v, want %v", got, want)
		}
	}
}
