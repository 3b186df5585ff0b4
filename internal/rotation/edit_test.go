package rotation

import (
	"bytes"
	"encoding/base64"
	"flag"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	apiserverv1 "k8s.io/apiserver/pkg/apis/apiserver/v1"
	"sigs.k8s.io/yaml"

	"github.com/rekey-io/rekey/pkg/transformers"
)

var updateGolden = flag.Bool("update", false, "rewrite the golden files in testdata/edits")

var rotateNow = time.Date(2026, 11, 23, 20, 30, 0, 0, time.UTC)

// fixedRandom is a deterministic key source so the golden files hold a known secret.
func fixedRandom() *bytes.Reader { return bytes.NewReader(bytes.Repeat([]byte{0xA5}, 64)) }

func readFile(t *testing.T, name string) *File {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("testdata", "edits", name))
	if err != nil {
		t.Fatal(err)
	}
	f, err := ParseFile(data, name)
	if err != nil {
		t.Fatalf("input %s is not valid: %v", name, err)
	}
	return f
}

// reparse is f after change edited its versioned object, as a file holding the result.
func reparse(t *testing.T, f *File, change func(*apiserverv1.EncryptionConfiguration)) *File {
	t.Helper()
	cfg := f.versioned.DeepCopy()
	change(cfg)
	data, err := yaml.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	out, err := ParseFile(data, "changed")
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// checkGolden compares data with testdata/edits/name.
func checkGolden(t *testing.T, data []byte, name string) {
	t.Helper()
	path := filepath.Join("testdata", "edits", name)
	if *updateGolden {
		if err := os.WriteFile(path, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -run TestEditsGolden -update to create it)", err)
	}
	if !bytes.Equal(data, want) {
		t.Errorf("%s differs:\n--- got\n%s--- want\n%s", name, data, want)
	}
}

// TestEditsGolden covers every switch rotate makes in one command: the added write key
// (the first edit) and the removal of the key it replaced (the second edit).
func TestEditsGolden(t *testing.T) {
	kms := Request{Provider: transformers.ProviderKMSv2, KMSName: "vault-b", KMSEndpoint: "unix:///var/run/kms-b.sock"}
	kmsTimeout := kms
	kmsTimeout.KMSTimeout = 5 * time.Second
	for _, tc := range []struct {
		name, in string
		r        Request
		newKey   string
		oldKey   string
		warn     bool
	}{
		{name: "aesgcm-same", in: "aesgcm.in.yaml", newKey: "key-20261123T203000Z-uws2ljnf", oldKey: "key1"},
		{name: "aesgcm-to-secretbox", in: "aesgcm.in.yaml", r: Request{Provider: transformers.ProviderSecretbox}, newKey: "key-20261123T203000Z-uws2ljnf", oldKey: "key1"},
		{name: "aescbc-same", in: "aescbc-two-keys.in.yaml", newKey: "key-20261123T203000Z-uws2ljnf", warn: true, oldKey: "key2"},
		{name: "aescbc-to-aesgcm", in: "aescbc-two-keys.in.yaml", r: Request{Provider: transformers.ProviderAESGCM}, newKey: "key-20261123T203000Z-uws2ljnf", oldKey: "key2"},
		{name: "identity-to-aesgcm", in: "identity.in.yaml", r: Request{Provider: transformers.ProviderAESGCM}, newKey: "key-20261123T203000Z-uws2ljnf", oldKey: "identity"},
		{name: "aesgcm-to-kms", in: "aesgcm.in.yaml", r: kms, newKey: "vault-b", oldKey: "key1"},
		{name: "aescbc-to-kms", in: "aescbc-two-keys.in.yaml", r: kms, newKey: "vault-b", oldKey: "key2"},
		{name: "identity-to-kms", in: "identity.in.yaml", r: kms, newKey: "vault-b", oldKey: "identity"},
		{name: "kms-to-kms", in: "kms.in.yaml", r: kmsTimeout, newKey: "vault-b", oldKey: "vault-a"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := readFile(t, tc.in)
			before, _ := yaml.Marshal(in.versioned)
			tc.r.Now, tc.r.Random = rotateNow, fixedRandom()
			added, err := Add(in, tc.r)
			if err != nil {
				t.Fatal(err)
			}
			if after, _ := yaml.Marshal(in.versioned); !bytes.Equal(before, after) {
				t.Fatal("Add changed its input")
			}
			if added.NewKey != tc.newKey {
				t.Errorf("new key = %q, want %q", added.NewKey, tc.newKey)
			}
			if got := len(added.Warnings) > 0; got != tc.warn {
				t.Errorf("warnings = %q, want a warning: %v", added.Warnings, tc.warn)
			}
			checkGolden(t, added.Data, tc.name+".add.yaml")
			if len(added.OldKeys) != 1 || added.OldKeys[0] != tc.oldKey {
				t.Errorf("old keys = %q, want [%s]", added.OldKeys, tc.oldKey)
			}

			next, err := ParseFile(added.Data, tc.name+".add.yaml")
			if err != nil {
				t.Fatal(err)
			}
			// The new write key is never removed as "old".
			if _, err := Remove(next, []string{added.NewKey}, nil); err == nil {
				t.Error("removing the write key itself was accepted")
			}
			removed, err := Remove(next, []string{tc.oldKey}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(removed.Rules, added.Rules) {
				t.Errorf("removed from rules %v, rotated %v", removed.Rules, added.Rules)
			}
			checkGolden(t, removed.Data, tc.name+".drop.yaml")
			// A re-run of the second edit finds nothing left to remove.
			final, err := ParseFile(removed.Data, tc.name+".drop.yaml")
			if err != nil {
				t.Fatal(err)
			}
			if _, err := Remove(final, []string{tc.oldKey}, nil); err == nil || !strings.Contains(err.Error(), "nothing to remove") {
				t.Errorf("second removal: err = %v, want nothing to remove", err)
			}
		})
	}
}

func TestAddRefuses(t *testing.T) {
	aesgcm := readFile(t, "aesgcm.in.yaml")
	twoRules := reparse(t, aesgcm, func(c *apiserverv1.EncryptionConfiguration) { c.Resources[1].Providers = c.Resources[0].Providers })
	twoIdentity := reparse(t, aesgcm, func(c *apiserverv1.EncryptionConfiguration) { c.Resources[0].Providers = c.Resources[1].Providers })
	kms := func(name, endpoint string) Request {
		return Request{Provider: transformers.ProviderKMSv2, KMSName: name, KMSEndpoint: endpoint}
	}
	for _, tc := range []struct {
		name string
		f    *File
		r    Request
		want string
	}{
		{"identity without --provider", readFile(t, "identity.in.yaml"), Request{}, "pass --provider aesgcm"},
		{"kms over two rules", twoRules, kms("b", "unix:///b.sock"), "choose one with --resources"},
		{"kms over two identity rules", twoIdentity, kms("b", "unix:///b.sock"), "choose one with --resources"},
		{"kms name taken", readFile(t, "kms.in.yaml"), kms("vault-a", "unix:///b.sock"), "already a KMS provider"},
		{"kms without name", readFile(t, "kms.in.yaml"), kms("", "unix:///b.sock"), "needs --kms-name"},
		{"kms tcp endpoint", readFile(t, "kms.in.yaml"), kms("b", "tcp://10.0.0.1:80"), "unix socket"},
		{"kms name with colon", readFile(t, "kms.in.yaml"), kms("a:b", "unix:///b.sock"), "contains ':'"},
		{"unknown type", aesgcm, Request{Provider: "rot13"}, "not one rotate writes with"},
		{"resources naming no rule", aesgcm, Request{Resources: []string{"pods"}}, "no rule naming pods"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.r.Now, tc.r.Random = rotateNow, fixedRandom()
			_, err := Add(tc.f, tc.r)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
		})
	}
}

func TestAddResourcesLimit(t *testing.T) {
	f := reparse(t, readFile(t, "aesgcm.in.yaml"), func(c *apiserverv1.EncryptionConfiguration) { c.Resources[1].Providers = c.Resources[0].Providers })
	added, err := Add(f, Request{Resources: []string{"events"}, Now: rotateNow, Random: fixedRandom()})
	if err != nil {
		t.Fatal(err)
	}
	if len(added.Rules) != 1 || added.Rules[0] != 1 {
		t.Fatalf("rotated rules %v, want only [1] (events)", added.Rules)
	}
}

func TestNewKeyName(t *testing.T) {
	random := rand.NewChaCha8([32]byte{1})
	// An existing name that is a start of the generated one: no suffix helps.
	if n, err := newKeyName(rotateNow, []string{"key-2026"}, random); err == nil {
		t.Errorf("newKeyName with key-2026 present = %q, want an error", n)
	}
	name := regexp.MustCompile(`^key-(\d{8}T\d{6}Z)-[a-z2-7]{8}$`)
	for _, tc := range []struct {
		existing []string
		wantTime string
	}{
		{nil, "20261123T203000Z"},
		{[]string{"key1"}, "20261123T203000Z"},
		// A name of the older form, without the random part, is a start of every name
		// of its second: the time moves on.
		{[]string{"key-20261123T203000Z"}, "20261123T203001Z"},
		{[]string{"key-20261123T203000Z", "key-20261123T203001Z"}, "20261123T203002Z"},
	} {
		got, err := newKeyName(rotateNow, tc.existing, random)
		if err != nil {
			t.Fatal(err)
		}
		if m := name.FindStringSubmatch(got); m == nil || m[1] != tc.wantTime {
			t.Errorf("newKeyName(%q) = %q, want key-%s-<8 base32 characters>", tc.existing, got, tc.wantTime)
		}
	}
	// A random part that is taken already (the source repeats itself) is drawn again.
	taken, err := newKeyName(rotateNow, nil, fixedRandom())
	if err != nil {
		t.Fatal(err)
	}
	if got, err := newKeyName(rotateNow, []string{taken}, fixedRandom()); err != nil || got == taken || strings.HasPrefix(got, taken) {
		t.Errorf("newKeyName with %q taken = %q, %v; want another name", taken, got, err)
	}
}

// Rotations of separate files in the same second (one file per apiserver, run in
// parallel) give distinct names, none a prefix of another, each a valid key name.
func TestNewKeyNamesDistinct(t *testing.T) {
	random := rand.NewChaCha8([32]byte{2})
	names := make([]string, 1000)
	for i := range names {
		n, err := newKeyName(rotateNow, nil, random)
		if err != nil {
			t.Fatal(err)
		}
		names[i] = n
	}
	slices.Sort(names)
	// Sorted, a name that is a prefix of another sorts right before one it prefixes.
	for i := 1; i < len(names); i++ {
		if strings.HasPrefix(names[i], names[i-1]) {
			t.Fatalf("generated names %q and %q: equal, or one is a prefix of the other", names[i-1], names[i])
		}
	}
	f := readFile(t, "aesgcm.in.yaml")
	e, err := Add(f, Request{Now: rotateNow, Random: random})
	if err != nil {
		t.Fatalf("a generated name is not a valid key name: %v", err)
	}
	if !strings.HasPrefix(e.NewKey, "key-20261123T203000Z-") || strings.Contains(e.NewKey, ":") {
		t.Errorf("new key %q, want key-20261123T203000Z-<random>", e.NewKey)
	}
}

// The second edit stays inside the rules --resources names: removing identity after a
// rotation of secrets must not touch a configmaps rule that still reads plaintext.
func TestRemoveKeepsToTheNamedResources(t *testing.T) {
	secret := base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{1}, 32))
	key := func(name string) apiserverv1.Key { return apiserverv1.Key{Name: name, Secret: secret} }
	aesgcm := func(names ...string) apiserverv1.ProviderConfiguration {
		var ks []apiserverv1.Key
		for _, n := range names {
			ks = append(ks, key(n))
		}
		return apiserverv1.ProviderConfiguration{AESGCM: &apiserverv1.AESConfiguration{Keys: ks}}
	}
	identity := apiserverv1.ProviderConfiguration{Identity: &apiserverv1.IdentityConfiguration{}}
	f := reparse(t, readFile(t, "aesgcm.in.yaml"), func(c *apiserverv1.EncryptionConfiguration) {
		c.Resources = []apiserverv1.ResourceConfiguration{
			{Resources: []string{"secrets"}, Providers: []apiserverv1.ProviderConfiguration{aesgcm("k2", "k1"), identity}},
			{Resources: []string{"configmaps"}, Providers: []apiserverv1.ProviderConfiguration{aesgcm("c1"), identity}},
		}
	})
	removed, err := Remove(f, []string{"identity"}, []string{"secrets"})
	if err != nil {
		t.Fatal(err)
	}
	got := removed.Config.Encryption.Resources
	if len(removed.Rules) != 1 || removed.Rules[0] != 0 || len(got[0].Providers) != 1 || len(got[1].Providers) != 2 {
		t.Fatalf("Remove(identity, --resources secrets) changed rules %v: %+v", removed.Rules, got)
	}
	if _, err := Remove(f, []string{"c1"}, []string{"secrets"}); err == nil || !strings.Contains(err.Error(), "no rule naming secrets") {
		t.Fatalf("Remove(c1, --resources secrets) = %v, want nothing to remove in secrets", err)
	}
	if removed, err := Remove(f, []string{"identity"}, nil); err != nil || len(removed.Rules) != 2 || len(removed.Config.Encryption.Resources[1].Providers) != 1 {
		t.Fatalf("Remove(identity) without --resources: %+v, err %v; want both rules", removed, err)
	}
}

// Read gives the machine the rules a rotation may concern, named as the apiservers
// publish their chains: a rule writing identity is left out, --resources narrows.
func TestFileRead(t *testing.T) {
	f := readFile(t, "aesgcm.in.yaml")
	fr := f.Read(Request{}, nil)
	if fr.Hash != f.Config.Hash || len(fr.Rules) != 1 {
		t.Fatalf("Read = %+v, want the aesgcm rule only, with the file's hash", fr)
	}
	if got := fr.Rules[0].Entries; len(got) != 2 || !got[0].SameEntry(Key{Provider: "aesgcm", Key: "key1"}) || got[0].Check == "" || got[1] != (Key{Provider: "identity"}) {
		t.Fatalf("entries %v, want aesgcm/key1, identity", got)
	}
	if got := Rules(f.Config); len(got) != 2 {
		t.Fatalf("Rules = %v, want both rules", got)
	}
	if fr := f.Read(Request{Resources: []string{"events"}}, nil); len(fr.Rules) != 0 {
		t.Fatalf("Read(events) = %v, want no rule (events writes identity)", fr.Rules)
	}
	// What is stored under a rule: every resource it names, whatever --resources
	// picked it by, and what the first edit would change.
	if fr := f.Read(Request{Resources: []string{"secrets"}}, nil); len(fr.Rules) != 1 || !slices.Equal(fr.Rules[0].Stored, []string{"secrets", "configmaps"}) ||
		!slices.Equal(fr.Rotates, []string{"secrets", "configmaps"}) {
		t.Fatalf("Read(--resources secrets) = %+v, want the rule with secrets and configmaps stored under it, both rotated", fr)
	}
	resolve := func(res []string) []string { return append(slices.Clone(res), "resolved") }
	if fr := f.Read(Request{}, resolve); !slices.Equal(fr.Rules[0].Stored, []string{"secrets", "configmaps", "resolved"}) {
		t.Fatalf("Read with a resolver: stored %v, want its answer", fr.Rules[0].Stored)
	}
	// First-time encryption: the first edit would change the identity rule.
	if fr := readFile(t, "identity.in.yaml").Read(Request{Provider: "aesgcm"}, nil); len(fr.Rules) != 0 || !slices.Equal(fr.Rotates, []string{"secrets"}) {
		t.Fatalf("Read(identity file, --provider aesgcm) = %+v, want no rule and secrets rotated", fr)
	}
}
