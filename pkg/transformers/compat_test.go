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

	"github.com/rekey-io/rekey/internal/compatconfigs"
	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// The configurations of the matrix live in internal/compatconfigs, so that the guard
// is tested over the same ones.
var configFor = compatconfigs.ConfigFor

const longCBCName = compatconfigs.LongCBCName

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

// loadOurs builds yaml with rekey alone, for tests whose subject is rekey's Set only.
func loadOurs(t testing.TB, name, yaml string) *transformers.Set {
	t.Helper()
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Load(path, config.Options{})
	if err != nil {
		t.Fatalf("%s: config: %v", name, err)
	}
	set, err := transformers.Build(context.Background(), cfg, transformers.Options{})
	if err != nil {
		t.Fatalf("%s: build: %v", name, err)
	}
	t.Cleanup(set.Close)
	return set
}

func loadPair(t testing.TB, name, yaml string) pair {
	t.Helper()
	path, up := loadUpstreamFile(t, name, yaml)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	cfg, err := config.Load(path, config.Options{})
	if err != nil {
		t.Fatalf("%s: config: %v", name, err)
	}
	set, err := transformers.Build(ctx, cfg, transformers.Options{})
	if err != nil {
		t.Fatalf("%s: build: %v", name, err)
	}
	t.Cleanup(set.Close)
	return pair{name: name, upstream: up, ours: set}
}

// loadUpstreamFile writes yaml to a file and loads it with kube-apiserver's loader; the
// transformers stop with the test.
func loadUpstreamFile(t testing.TB, name, yaml string) (string, encryptionconfig.StaticTransformers) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	up, err := encryptionconfig.LoadEncryptionConfig(ctx, path, false, "compat")
	if err != nil && strings.Contains(err.Error(), "FIPS 140-only mode") {
		// Upstream builds aesgcm (and KMS) with cipher.NewGCM, refused there.
		enctest.SkipUnderFIPSOnly(t, "the test compares rekey with upstream's transformers, which cannot load ["+name+"] in this mode: "+err.Error())
	}
	if err != nil {
		t.Fatalf("%s: upstream: %v", name, err)
	}
	return path, up.Transformers
}

var secrets = schema.GroupResource{Resource: "secrets"}

// TestCrossReadMatrix writes a value with every config, by upstream and by us, and reads
// it with every config, by upstream and by us: our read must agree with upstream's read
// on success, plaintext and the stale flag, whoever wrote it.
func TestCrossReadMatrix(t *testing.T) {
	orders := compatconfigs.Orders
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
					// aescbc has no MAC. When two aescbc keys have the same prefix
					// (aescbc-other and aescbc both name key1), the key listed first
					// "succeeds" with garbage whenever the garbage ends in valid padding
					// (about 1 read in 256), on both sides alike: they must still agree.
					sameName := (strings.Contains(r.name, "aescbc-other") || strings.Contains(w.name, "aescbc-other")) &&
						strings.Contains(r.name, "aescbc") && strings.Contains(w.name, "aescbc")
					// When one key name's prefix is a proper prefix of another's (a and
					// a:bcdefghijklmnop), upstream opens the long key's values with the short
					// key first and returns garbage in the same case; rekey tries the longest
					// prefix first and must return the plaintext.
					upstreamGarbage := strings.Contains(r.name, "aescbc-short-first") && strings.Contains(w.name, "aescbc-") &&
						!bytes.Equal(upOut, pt)
					if !bytes.Equal(ourOut, pt) && !sameName {
						t.Fatalf("%s: rekey read a different plaintext", where)
					}
					if upstreamGarbage {
						checked++
						continue
					}
					if upStale != ourStale {
						t.Fatalf("%s: upstream stale=%v, ours stale=%v", where, upStale, ourStale)
					}
					if !bytes.Equal(upOut, ourOut) {
						t.Fatalf("%s: upstream and rekey read different plaintexts", where)
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
	yaml := compatconfigs.Lookup
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

// TestOverlappingKeyNamesReadWithTheLongestPrefix is the case upstream gets wrong: aescbc
// keys "a" and "a:bcdefghijklmnop", the short one listed first. A value of the long key
// also carries the short key's prefix; opened with the short key its garbage ends in
// valid padding about once in 256 values. The test searches for such values (upstream
// returns garbage for them) and requires rekey to return the plaintext, stale, as the
// long key is not the write key.
func TestOverlappingKeyNamesReadWithTheLongestPrefix(t *testing.T) {
	ctx := context.Background()
	aad := value.DefaultContext("/registry/secrets/ns/name")
	writer := loadPair(t, "long-first", configFor("secrets", "aescbc-long-first"))
	reader := loadPair(t, "short-first", configFor("secrets", "aescbc-short-first"))
	pt := []byte("k8s\x00\x0a\x0fsome secret protobuf")
	garbage := 0
	for i := 0; i < 20000 && garbage < 3; i++ {
		v, err := writer.our(secrets).TransformToStorage(ctx, pt, aad)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(string(v), "k8s:enc:aescbc:v1:"+longCBCName+":") {
			t.Fatalf("written with prefix %q", storedPrefix(v))
		}
		upOut, _, upErr := reader.up(secrets).TransformFromStorage(ctx, v, aad)
		if upErr != nil {
			t.Fatalf("upstream cannot read a value of its second key: %v", upErr)
		}
		if !bytes.Equal(upOut, pt) {
			garbage++
		}
		ourOut, stale, err := reader.our(secrets).TransformFromStorage(ctx, v, aad)
		if err != nil || !bytes.Equal(ourOut, pt) || !stale {
			t.Fatalf("value %d (upstream garbage: %v): rekey read err=%v stale=%v plaintext ok=%v", i, !bytes.Equal(upOut, pt), err, stale, bytes.Equal(ourOut, pt))
		}
	}
	if garbage == 0 {
		t.Fatal("no value hit upstream's wrong-key read; the test did not exercise the case")
	}
	// A value of the short key is still read with the short key, current.
	v, _ := reader.our(secrets).TransformToStorage(ctx, pt, aad)
	for who, tr := range map[string]value.Transformer{"upstream": reader.up(secrets), "rekey": reader.our(secrets)} {
		out, stale, err := tr.TransformFromStorage(ctx, v, aad)
		if err != nil || stale || !bytes.Equal(out, pt) {
			t.Errorf("%s: short key's own value: err=%v stale=%v", who, err, stale)
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
		tr := loadOurs(t, prov, configFor("secrets", prov)).TransformerFor(secrets)
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
	cbc := loadOurs(t, "cbc-iv-only", configFor("secrets", "aescbc"))
	ivOnly := append([]byte("k8s:enc:aescbc:v1:key1:"), make([]byte, 16)...)
	if _, _, err := cbc.TransformerFor(secrets).TransformFromStorage(ctx, ivOnly, aad); err == nil {
		t.Fatal("an IV-only aescbc value must be an error")
	}
}

func TestUnknownPrefixAndIdentityRefusal(t *testing.T) {
	ctx := context.Background()
	aad := value.DefaultContext("/registry/secrets/a/b")
	gcm := loadOurs(t, "gcm", configFor("secrets", "aesgcm"))
	_, _, err := gcm.TransformerFor(secrets).TransformFromStorage(ctx, []byte("plain"), aad)
	if err == nil || !strings.Contains(err.Error(), "no matching prefix found") {
		t.Fatalf("plaintext under an aesgcm-only config: %v", err)
	}
	id := loadPair(t, "identity", configFor("secrets", "identity"))
	enc, _ := gcm.TransformerFor(secrets).TransformToStorage(ctx, []byte("x"), aad)
	_, _, ourErr := id.our(secrets).TransformFromStorage(ctx, enc, aad)
	_, _, upErr := id.up(secrets).TransformFromStorage(ctx, enc, aad)
	if ourErr == nil || upErr == nil {
		t.Fatalf("identity must refuse encrypted data: ours=%v upstream=%v", ourErr, upErr)
	}
	// Resources with no rule fall back to identity that refuses encrypted data.
	_, _, err = gcm.TransformerFor(schema.GroupResource{Resource: "pods"}).TransformFromStorage(ctx, enc, aad)
	if err == nil {
		t.Fatal("fallback identity read encrypted data")
	}
}
