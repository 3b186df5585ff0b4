package transformers_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/server/options/encryptionconfig"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Provider snippets used to assemble configs. Keys differ per provider so a value
// written by one provider can never be read by another by accident.
var providerYAML = map[string]string{
	"identity":       "      - identity: {}\n",
	"aesgcm":         "      - aesgcm:\n          keys:\n            - {name: key1, secret: " + b64(32, 1) + "}\n            - {name: key2, secret: " + b64(16, 2) + "}\n",
	"aesgcm-rev":     "      - aesgcm:\n          keys:\n            - {name: key2, secret: " + b64(16, 2) + "}\n            - {name: key1, secret: " + b64(32, 1) + "}\n",
	"aescbc":         "      - aescbc:\n          keys:\n            - {name: key1, secret: " + b64(32, 3) + "}\n            - {name: key2, secret: " + b64(24, 4) + "}\n",
	"aescbc-rev":     "      - aescbc:\n          keys:\n            - {name: key2, secret: " + b64(24, 4) + "}\n            - {name: key1, secret: " + b64(32, 3) + "}\n",
	"secretbox":      "      - secretbox:\n          keys:\n            - {name: key1, secret: " + b64(32, 5) + "}\n            - {name: key2, secret: " + b64(32, 6) + "}\n",
	"secretbox-rev":  "      - secretbox:\n          keys:\n            - {name: key2, secret: " + b64(32, 6) + "}\n            - {name: key1, secret: " + b64(32, 5) + "}\n",
	"aescbc-other":   "      - aescbc:\n          keys:\n            - {name: key1, secret: " + b64(32, 7) + "}\n", // same prefix as aescbc key1, different key
	"aesgcm-only-k2": "      - aesgcm:\n          keys:\n            - {name: key2, secret: " + b64(16, 2) + "}\n",
}

func b64(n int, seed byte) string {
	k := make([]byte, n)
	for i := range k {
		k[i] = seed*31 + byte(i)*7 + 1
	}
	return encodeStd(k)
}

func configFor(resources string, providers ...string) string {
	var b strings.Builder
	b.WriteString("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [" + resources + "]\n    providers:\n")
	for _, p := range providers {
		b.WriteString(providerYAML[p])
	}
	return b.String()
}

// pair is one configuration built twice: by upstream and by us.
type pair struct {
	name     string
	upstream encryptionconfig.StaticTransformers
	ours     *transformers.Set
}

func (p pair) up(gr schema.GroupResource) value.Transformer {
	return p.upstream.TransformerForResource(gr)
}
func (p pair) our(gr schema.GroupResource) value.Transformer { return p.ours.TransformerFor(gr) }

func loadPair(t testing.TB, name, yaml string) pair {
	t.Helper()
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	up, err := encryptionconfig.LoadEncryptionConfig(ctx, path, false, "compat")
	if err != nil {
		t.Fatalf("%s: upstream: %v", name, err)
	}
	cfg, err := config.Load(path, config.Options{})
	if err != nil {
		t.Fatalf("%s: config: %v", name, err)
	}
	set, err := transformers.Build(ctx, cfg, transformers.Options{})
	if err != nil {
		t.Fatalf("%s: build: %v", name, err)
	}
	t.Cleanup(set.Close)
	return pair{name: name, upstream: up.Transformers, ours: set}
}

var secrets = schema.GroupResource{Resource: "secrets"}

// TestCrossReadMatrix writes a value with every config, by upstream and by us, and reads
// it with every config, by upstream and by us: our read must agree with upstream's read
// on success, plaintext and the stale flag, whoever wrote it.
func TestCrossReadMatrix(t *testing.T) {
	orders := [][]string{
		{"identity"},
		{"aesgcm"}, {"aesgcm-rev"}, {"aesgcm-only-k2"},
		{"aescbc"}, {"aescbc-rev"},
		{"secretbox"}, {"secretbox-rev"},
		{"identity", "aesgcm", "aescbc", "secretbox"},
		{"aesgcm", "secretbox", "aescbc", "identity"},
		{"aescbc", "identity", "secretbox", "aesgcm"},
		{"secretbox", "aescbc", "identity", "aesgcm"},
		{"aesgcm-rev", "aescbc-rev", "secretbox-rev"},
		{"aescbc-other", "aescbc"}, // overlapping prefixes: a failing provider must not stop the search
		{"aescbc", "aescbc-other"},
	}
	var pairs []pair
	for _, o := range orders {
		pairs = append(pairs, loadPair(t, strings.Join(o, ","), configFor("secrets", o...)))
	}
	aad := value.DefaultContext("/registry/secrets/ns/name")
	plaintexts := [][]byte{[]byte("k8s\x00\x0a\x0fsome secret protobuf"), {}, bytes.Repeat([]byte{0xa5}, 16), bytes.Repeat([]byte("x"), 4097)}
	ctx := context.Background()
	checked := 0
	for _, w := range pairs {
		for _, writer := range []struct {
			who string
			t   value.Transformer
		}{{"upstream", w.up(secrets)}, {"rekey", w.our(secrets)}} {
			for _, pt := range plaintexts {
				stored, err := writer.t.TransformToStorage(ctx, pt, aad)
				if err != nil {
					t.Fatalf("write %s/%s: %v", w.name, writer.who, err)
				}
				for _, r := range pairs {
					upOut, upStale, upErr := r.up(secrets).TransformFromStorage(ctx, stored, aad)
					ourOut, ourStale, ourErr := r.our(secrets).TransformFromStorage(ctx, stored, aad)
					where := fmt.Sprintf("written by %s with [%s], read with [%s], %d bytes", writer.who, w.name, r.name, len(pt))
					if (upErr == nil) != (ourErr == nil) {
						t.Fatalf("%s: upstream err=%v, ours err=%v", where, upErr, ourErr)
					}
					if upErr != nil {
						continue
					}
					if upStale != ourStale {
						t.Fatalf("%s: upstream stale=%v, ours stale=%v", where, upStale, ourStale)
					}
					if !bytes.Equal(upOut, ourOut) {
						t.Fatalf("%s: upstream and rekey read different plaintexts", where)
					}
					// aescbc has no MAC: when two aescbc keys share a prefix (aescbc-other
					// and aescbc both name key1), the wrong key "succeeds"
					// whenever its garbage ends in valid padding (about 1 read in 256), on
					// both sides alike. Everything else must return the plaintext.
					cbcAmbiguous := (strings.Contains(r.name, "aescbc-other") || strings.Contains(w.name, "aescbc-other")) &&
						strings.Contains(r.name, "aescbc") && strings.Contains(w.name, "aescbc")
					if !bytes.Equal(ourOut, pt) && !cbcAmbiguous {
						t.Fatalf("%s: plaintext differs", where)
					}
					checked++
				}
			}
		}
	}
	if checked < len(pairs)*len(pairs) {
		t.Fatalf("only %d successful cross reads; the matrix is not exercising much", checked)
	}
}

// TestWritePrefixAndLookupMatchUpstream checks which provider and key write for each
// resource, through exact, group-wildcard, *.* and fallback lookups.
func TestWritePrefixAndLookupMatchUpstream(t *testing.T) {
	yaml := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n" +
		"  - resources: [secrets, configmaps]\n    providers:\n" + providerYAML["aesgcm"] + providerYAML["identity"] +
		"  - resources: ['*.apps']\n    providers:\n" + providerYAML["secretbox"] +
		"  - resources: [secrets]\n    providers:\n" + providerYAML["aescbc"] + // appended to secrets' list
		"  - resources: ['*.*']\n    providers:\n" + providerYAML["aescbc-rev"]
	p := loadPair(t, "lookup", yaml)
	ctx := context.Background()
	aad := value.DefaultContext("/registry/x/y")
	for _, gr := range []schema.GroupResource{
		{Resource: "secrets"}, {Resource: "configmaps"}, {Resource: "pods"},
		{Group: "apps", Resource: "deployments"}, {Group: "batch", Resource: "jobs"}, {Group: "apps", Resource: "*"},
	} {
		up, err := p.up(gr).TransformToStorage(ctx, []byte("v"), aad)
		if err != nil {
			t.Fatal(err)
		}
		ours, err := p.our(gr).TransformToStorage(ctx, []byte("v"), aad)
		if err != nil {
			t.Fatal(err)
		}
		if upPrefix, ourPrefix := storedPrefix(up), storedPrefix(ours); upPrefix != ourPrefix {
			t.Errorf("%s: upstream writes %q, we write %q", gr, upPrefix, ourPrefix)
		}
		// Each implementation reads the other's value with the same stale flag.
		_, s1, e1 := p.our(gr).TransformFromStorage(ctx, up, aad)
		_, s2, e2 := p.up(gr).TransformFromStorage(ctx, ours, aad)
		if e1 != nil || e2 != nil || s1 || s2 {
			t.Errorf("%s: cross read: ours(err=%v stale=%v) upstream(err=%v stale=%v)", gr, e1, s1, e2, s2)
		}
	}
	// secrets lists aesgcm, identity, then (second entry) aescbc: a value under aescbc
	// is readable and stale on both sides.
	cbcOnly := loadPair(t, "cbc", configFor("secrets", "aescbc"))
	v, _ := cbcOnly.our(secrets).TransformToStorage(ctx, []byte("v"), aad)
	for who, tr := range map[string]value.Transformer{"upstream": p.up(secrets), "rekey": p.our(secrets)} {
		if _, stale, err := tr.TransformFromStorage(ctx, v, aad); err != nil || !stale {
			t.Errorf("%s: read from the appended entry: err=%v stale=%v, want ok and stale", who, err, stale)
		}
	}
}

// storedPrefix cuts a stored value at its key name: "k8s:enc:aesgcm:v1:key1:" or "" for plaintext.
func storedPrefix(v []byte) string {
	if !bytes.HasPrefix(v, []byte("k8s:enc:")) {
		return ""
	}
	parts := bytes.SplitN(v, []byte(":"), 6)
	if len(parts) < 6 {
		return string(v)
	}
	return string(bytes.Join(parts[:5], []byte(":"))) + ":"
}

// TestAuthenticatedDataBinding: GCM values moved to another etcd key fail on both sides;
// CBC and secretbox do not bind the key (upstream behaviour, kept for compatibility).
func TestAuthenticatedDataBinding(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		provider string
		bindsAAD bool
	}{{"aesgcm", true}, {"aescbc", false}, {"secretbox", false}} {
		p := loadPair(t, tc.provider, configFor("secrets", tc.provider))
		for _, writer := range []value.Transformer{p.up(secrets), p.our(secrets)} {
			v, err := writer.TransformToStorage(ctx, []byte("payload"), value.DefaultContext("/registry/secrets/a/b"))
			if err != nil {
				t.Fatal(err)
			}
			moved := value.DefaultContext("/registry/secrets/a/c")
			_, _, upErr := p.up(secrets).TransformFromStorage(ctx, v, moved)
			_, _, ourErr := p.our(secrets).TransformFromStorage(ctx, v, moved)
			if (upErr != nil) != tc.bindsAAD || (ourErr != nil) != tc.bindsAAD {
				t.Errorf("%s moved value: upstream err=%v, ours err=%v, want failure=%v", tc.provider, upErr, ourErr, tc.bindsAAD)
			}
		}
	}
}

// TestCorruptValuesNeverPanic truncates and bit-flips values of every provider: reads must
// fail cleanly (including upstream's panic case: an aescbc value that is only an IV).
func TestCorruptValuesNeverPanic(t *testing.T) {
	ctx := context.Background()
	aad := value.DefaultContext("/registry/secrets/a/b")
	for _, prov := range []string{"aesgcm", "aescbc", "secretbox"} {
		p := loadPair(t, prov, configFor("secrets", prov))
		tr := p.our(secrets)
		v, err := tr.TransformToStorage(ctx, bytes.Repeat([]byte("p"), 33), aad)
		if err != nil {
			t.Fatal(err)
		}
		prefix := storedPrefix(v)
		for n := len(prefix); n < len(v); n++ {
			if _, _, err := tr.TransformFromStorage(ctx, v[:n], aad); err == nil && prov != "aescbc" {
				t.Errorf("%s truncated to %d bytes read without error", prov, n)
			}
		}
		for i := len(prefix); i < len(v); i++ {
			flipped := bytes.Clone(v)
			flipped[i] ^= 0x01
			out, _, err := tr.TransformFromStorage(ctx, flipped, aad)
			if err == nil && prov != "aescbc" {
				t.Errorf("%s with bit %d flipped read without error", prov, i)
			}
			if err == nil && bytes.Equal(out, bytes.Repeat([]byte("p"), 33)) && prov == "aescbc" && i >= len(prefix)+16 {
				t.Errorf("aescbc bit flip in ciphertext byte %d went unnoticed in the plaintext", i)
			}
		}
	}
	// The exact upstream panic: aescbc prefix + a 16-byte IV and nothing else.
	p := loadPair(t, "cbc-iv-only", configFor("secrets", "aescbc"))
	ivOnly := append([]byte("k8s:enc:aescbc:v1:key1:"), make([]byte, 16)...)
	if _, _, err := p.our(secrets).TransformFromStorage(ctx, ivOnly, aad); err == nil {
		t.Fatal("an IV-only aescbc value must be an error")
	}
}

func TestUnknownPrefixAndIdentityRefusal(t *testing.T) {
	ctx := context.Background()
	aad := value.DefaultContext("/registry/secrets/a/b")
	p := loadPair(t, "gcm", configFor("secrets", "aesgcm"))
	_, _, err := p.our(secrets).TransformFromStorage(ctx, []byte("plain"), aad)
	if err == nil || !strings.Contains(err.Error(), "no matching prefix found") {
		t.Fatalf("plaintext under an aesgcm-only config: %v", err)
	}
	id := loadPair(t, "identity", configFor("secrets", "identity"))
	enc, _ := p.our(secrets).TransformToStorage(ctx, []byte("x"), aad)
	_, _, ourErr := id.our(secrets).TransformFromStorage(ctx, enc, aad)
	_, _, upErr := id.up(secrets).TransformFromStorage(ctx, enc, aad)
	if ourErr == nil || upErr == nil {
		t.Fatalf("identity must refuse encrypted data: ours=%v upstream=%v", ourErr, upErr)
	}
	// Resources with no rule fall back to identity that refuses encrypted data.
	_, _, err = p.our(schema.GroupResource{Resource: "pods"}).TransformFromStorage(ctx, enc, aad)
	if err == nil {
		t.Fatal("fallback identity read encrypted data")
	}
}
