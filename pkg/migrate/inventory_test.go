package migrate

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/encoding/protowire"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// kmsValue hand-encodes a stored KMS v2 value: prefix ‖ protobuf EncryptedObject.
func kmsValue(provider, keyID string) string {
	var b []byte
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	b = protowire.AppendBytes(b, []byte("ciphertext-not-decrypted-by-the-inventory"))
	b = protowire.AppendTag(b, 2, protowire.BytesType)
	b = protowire.AppendString(b, keyID)
	b = protowire.AppendTag(b, 3, protowire.BytesType)
	b = protowire.AppendBytes(b, []byte("encrypted-seed"))
	b = protowire.AppendTag(b, 5, protowire.VarintType)
	b = protowire.AppendVarint(b, 1)
	return "k8s:enc:kms:v2:" + provider + ":" + string(b)
}

func sha(s string) string {
	sum := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(sum[:])
}

func TestInventoryCountsPerProviderKeyAndState(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	_, old := setFor(t, "secrets, configmaps", "aesgcm:key1")
	writeObjects(t, cli, old, secrets, 30)
	writeObjects(t, cli, old, configmaps, 20)
	// Plaintext, a key no configuration knows, and KMS v2 values under two key ids.
	for i := 0; i < 5; i++ {
		mustPut(t, cli, keyOf(secrets, "plain", fmt.Sprint(i)), string(storedObject("plaintext")))
	}
	for i := 0; i < 3; i++ {
		mustPut(t, cli, keyOf(secrets, "ghost", fmt.Sprint(i)), "k8s:enc:aesgcm:v1:ghost:\x01\x02\x03nonce-and-ciphertext")
	}
	for i := 0; i < 4; i++ {
		mustPut(t, cli, keyOf(secrets, "kms-a", fmt.Sprint(i)), kmsValue("plug", "key-a"))
	}
	mustPut(t, cli, keyOf(secrets, "kms-b", "0"), kmsValue("plug", "key-b"))
	// Another resource's keys must not be counted.
	mustPut(t, cli, "/registry/secretsfoo/x", "k8s:enc:aesgcm:v1:key1:zzz")

	// New configuration: key2 writes, key1 and identity still read.
	cfg, next := setFor(t, "secrets, configmaps", "aesgcm:key2,key1", "identity")
	inv, err := TakeInventory(ctx, InventoryOptions{Client: cli, Source: FromSet(next), Resources: testResources(), ConfigHash: cfg.Hash, PageSize: 7})
	if err != nil {
		t.Fatal(err)
	}
	s := inv.Find("secrets")
	if s == nil || s.Objects != 30+5+3+4+1 {
		t.Fatalf("secrets inventory = %+v, want 43 objects", s)
	}
	if got := bucketCount(s, "k8s:enc:aesgcm:v1:key1:", true); got != 30 {
		t.Errorf("stale key1 secrets = %d, want 30", got)
	}
	if got := bucketCount(s, "", true); got != 5 || s.Plaintext != 5 {
		t.Errorf("stale plaintext secrets = %d (Plaintext %d), want 5", got, s.Plaintext)
	}
	if s.Stale != 35 {
		t.Errorf("stale secrets = %d, want 35 (30 key1 + 5 plaintext; unreadable ones apart)", s.Stale)
	}
	// ghost (unknown key) and kms (no kms provider configured) cannot be read.
	if s.Unreadable != 8 {
		t.Errorf("unreadable secrets = %d, want 8: %+v", s.Unreadable, s.Buckets)
	}
	var ghost, kmsA, kmsB *Count
	for i := range s.Buckets {
		b := &s.Buckets[i]
		switch {
		case b.Key == "ghost":
			ghost = b
		case b.KeyIDHash == sha("key-a"):
			kmsA = b
		case b.KeyIDHash == sha("key-b"):
			kmsB = b
		}
	}
	if ghost == nil || ghost.KnownKey || ghost.Objects != 3 || ghost.Provider != transformers.ProviderAESGCM {
		t.Errorf("ghost bucket = %+v, want 3 aesgcm objects under unknown key ghost", ghost)
	}
	if kmsA == nil || kmsA.Objects != 4 || kmsA.Key != "plug" || kmsA.Provider != transformers.ProviderKMSv2 || kmsA.DEKSourceType != "HKDF_SHA256_XNONCE_AES_GCM_SEED" {
		t.Errorf("kms key-a bucket = %+v, want 4 objects of provider plug", kmsA)
	}
	if kmsB == nil || kmsB.Objects != 1 {
		t.Errorf("kms key-b bucket = %+v, want 1 object", kmsB)
	}
	c := inv.Find("configmaps")
	if c == nil || c.Objects != 20 || c.Stale != 20 || bucketCount(c, "k8s:enc:aesgcm:v1:key1:", true) != 20 {
		t.Errorf("configmaps inventory = %+v, want 20 stale key1 objects", c)
	}
	if s.Revision == 0 || s.WritePrefix != "k8s:enc:aesgcm:v1:key2:" {
		t.Errorf("revision %d, write prefix %q", s.Revision, s.WritePrefix)
	}

	// The decrypt check agrees, and finds a corrupted value the prefix cannot show.
	mustPut(t, cli, keyOf(secrets, "ns0", "obj-000000"), "k8s:enc:aesgcm:v1:key1:corrupted-bytes-of-some-length")
	inv, err = TakeInventory(ctx, InventoryOptions{Client: cli, Source: FromSet(next), Resources: testResources(), DecryptCheck: true})
	if err != nil {
		t.Fatal(err)
	}
	s = inv.Find("secrets")
	if s.Unreadable != 9 {
		t.Errorf("decrypt check: unreadable = %d, want 9 (ghost 3, kms 5, corrupt 1); keys %v", s.Unreadable, s.UnreadableKeys)
	}
	if s.Stale != 34 {
		// 29 readable key1 + 5 plaintext.
		t.Errorf("decrypt check: stale = %d, want 34", s.Stale)
	}
}

func TestInventoryWithCurrentKeyShowsNothingStale(t *testing.T) {
	cli := startEtcd(t)
	_, set := setFor(t, "secrets", "aescbc:k1", "identity")
	writeObjects(t, cli, set, secrets, 25)
	inv, err := TakeInventory(context.Background(), InventoryOptions{Client: cli, Source: FromSet(set), Resources: testResources()[:1], DecryptCheck: true})
	if err != nil {
		t.Fatal(err)
	}
	s := inv.Find("secrets")
	if s.Objects != 25 || s.Stale != 0 || s.Unreadable != 0 || bucketCount(s, "k8s:enc:aescbc:v1:k1:", false) != 25 {
		t.Fatalf("inventory = %+v, want 25 current aescbc k1 objects", s)
	}
}

func TestClassifyKeyNamesWithColons(t *testing.T) {
	_, set := setFor(t, "secrets", "aesgcm:a:b,a")
	cl := newClassifier(FromSet(set).Rule(secrets), FromSet(set).KnownPrefixes())
	for v, want := range map[string]string{
		"k8s:enc:aesgcm:v1:a:b:\x00\x01": "k8s:enc:aesgcm:v1:a:b:",
		"k8s:enc:aesgcm:v1:a:\x00\x01":   "k8s:enc:aesgcm:v1:a:",
		"k8s:enc:aesgcm:v1:zz:\x00\x01":  "k8s:enc:aesgcm:v1:zz:",
		"k8s:enc:aesgcm:v1:\xff\xfe:":    "k8s:enc:aesgcm:v1:",
	} {
		b := cl.classify([]byte(v))
		if b.Prefix != want {
			t.Errorf("classify(%q) prefix = %q, want %q", v, b.Prefix, want)
		}
	}
	if b := cl.classify([]byte("k8s:enc:aesgcm:v1:a:b:xx")); b.Key != "a:b" || !b.KnownKey || b.Stale {
		t.Errorf("write key a:b classified as %+v", b)
	}
}

func mustPut(t testing.TB, cli *clientv3.Client, k, v string) {
	t.Helper()
	if _, err := cli.Put(context.Background(), k, v); err != nil {
		t.Fatal(err)
	}
}

// TestInventoryBucketsAreBounded: every key name found in etcd makes a bucket, so a
// corrupt or hostile etcd with 1,000 distinct unknown key names must not make 1,000
// buckets (and 1,000 rekey_storage_objects series); the rest are counted in "other".
func TestInventoryBucketsAreBounded(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	const n = 1000
	var ops []clientv3.Op
	for i := 0; i < n; i++ {
		ops = append(ops, clientv3.OpPut(keyOf(secrets, "ghosts", fmt.Sprintf("g%04d", i)), fmt.Sprintf("k8s:enc:aesgcm:v1:ghost-%04d:nonce-and-ciphertext", i)))
		if len(ops) == 100 {
			if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
				t.Fatal(err)
			}
			ops = ops[:0]
		}
	}
	_, set := setFor(t, "secrets", "aesgcm:key1")
	writeObjects(t, cli, set, secrets, 10)
	reg := metrics.NewKubeRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, decrypt := range []bool{false, true} {
		inv, err := TakeInventory(ctx, InventoryOptions{Client: cli, Source: FromSet(set), Resources: []Resource{ResourceFor(DefaultEtcdPrefix, secrets)}, DecryptCheck: decrypt, Metrics: m})
		if err != nil {
			t.Fatal(err)
		}
		ri := inv.Find("secrets")
		if len(ri.Buckets) > maxBucketsPerResource+2 { // + key1 + other
			t.Fatalf("decrypt=%v: %d buckets for %d distinct key names; the bound is %d (+ other)", decrypt, len(ri.Buckets), n, maxBucketsPerResource)
		}
		var objects, unreadable, other int64
		for _, b := range ri.Buckets {
			objects += b.Objects
			if b.Other {
				other += b.Objects
				if b.Prefix != "k8s:enc:" || b.KnownKey || b.Key != "" {
					t.Fatalf("other bucket of unknown keys = %+v", b.Bucket)
				}
			}
		}
		unreadable = ri.Unreadable
		if objects != n+10 || ri.Objects != n+10 || unreadable != n {
			t.Fatalf("decrypt=%v: %d objects in buckets, %d counted, %d unreadable; want %d, %d, %d", decrypt, objects, ri.Objects, unreadable, n+10, n+10, n)
		}
		// The configuration's key always keeps its bucket, though its objects come last.
		if bucketCount(ri, "k8s:enc:aesgcm:v1:key1:", false) != 10 {
			t.Fatalf("decrypt=%v: key1's bucket lost objects: %+v", decrypt, ri.Buckets)
		}
		if ri.OtherBuckets != n-maxBucketsPerResource || other != ri.OtherBuckets {
			t.Fatalf("decrypt=%v: OtherBuckets = %d, objects in other = %d; want %d", decrypt, ri.OtherBuckets, other, n-maxBucketsPerResource)
		}
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "rekey_storage_objects" && len(mf.GetMetric()) > maxBucketsPerResource+2 {
				t.Fatalf("rekey_storage_objects has %d series", len(mf.GetMetric()))
			}
		}
	}
}

// InventoryOptions.Revision reads every resource at that one revision: objects written
// after it are not counted, in any resource, and a compacted revision is an error.
func TestInventoryAtOneRevision(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	_, set := setFor(t, "secrets, configmaps", "aesgcm:key1")
	writeObjects(t, cli, set, secrets, 6)
	resp, err := cli.Get(ctx, "x")
	if err != nil {
		t.Fatal(err)
	}
	rev := resp.Header.Revision
	writeObjects(t, cli, set, configmaps, 4)
	for i := 0; i < 3; i++ {
		mustPut(t, cli, keyOf(secrets, "later", fmt.Sprint(i)), string(storedObject("plaintext")))
	}
	inv, err := TakeInventory(ctx, InventoryOptions{Client: cli, Source: FromSet(set), Resources: testResources(), Revision: rev, PageSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	if s, c := inv.Find("secrets"), inv.Find("configmaps"); s.Objects != 6 || s.Plaintext != 0 || c.Objects != 0 || s.Revision != rev {
		t.Fatalf("at revision %d: secrets %+v, configmaps %+v; want 6 secrets and no configmap", rev, s, c)
	}
	now, err := TakeInventory(ctx, InventoryOptions{Client: cli, Source: FromSet(set), Resources: testResources()})
	if err != nil {
		t.Fatal(err)
	}
	if s, c := now.Find("secrets"), now.Find("configmaps"); s.Objects != 9 || c.Objects != 4 {
		t.Fatalf("latest: secrets %d, configmaps %d; want 9 and 4", s.Objects, c.Objects)
	}
	last, err := cli.Get(ctx, "x")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Compact(ctx, last.Header.Revision); err != nil {
		t.Fatal(err)
	}
	_, err = TakeInventory(ctx, InventoryOptions{Client: cli, Source: FromSet(set), Resources: testResources(), Revision: rev})
	if err == nil || !strings.Contains(err.Error(), "compacted") {
		t.Fatalf("at a compacted revision: err = %v", err)
	}
}
