package migrate

import (
	"context"
	"testing"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// TestTallyCountsOneObjectAtATime feeds a tally stored values directly, no etcd: a
// stale key1 value, a current key2 value, plaintext, and two values under a key no
// configuration knows, one of them acknowledged; then a key1 value whose bytes are
// corrupted, which only the decrypt check finds unreadable.
func TestTallyCountsOneObjectAtATime(t *testing.T) {
	ctx := context.Background()
	_, old := setFor(t, "secrets", "aesgcm:key1")
	_, next := setFor(t, "secrets", "aesgcm:key2,key1", "identity")
	res := ResourceFor(DefaultEtcdPrefix, secrets)
	encrypt := func(set *transformers.Set, key string) []byte {
		out, err := set.TransformerFor(secrets).TransformToStorage(ctx, plaintextFor(key, 1), value.DefaultContext(key))
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	stale, current, plain := keyOf(secrets, "a", "stale"), keyOf(secrets, "a", "current"), keyOf(secrets, "a", "plain")
	ghost, acked, corrupt := keyOf(secrets, "b", "ghost"), keyOf(secrets, "b", "acked"), keyOf(secrets, "c", "corrupt")
	kvs := []*mvccpb.KeyValue{
		{Key: []byte(stale), Value: encrypt(old, stale), ModRevision: 2},
		{Key: []byte(current), Value: encrypt(next, current), ModRevision: 3},
		{Key: []byte(plain), Value: storedObject("plaintext"), ModRevision: 4},
		{Key: []byte(ghost), Value: []byte("k8s:enc:aesgcm:v1:ghost:nonce-and-ciphertext"), ModRevision: 5},
		{Key: []byte(acked), Value: []byte("k8s:enc:aesgcm:v1:ghost:other-ciphertext"), ModRevision: 6},
		{Key: []byte(corrupt), Value: []byte("k8s:enc:aesgcm:v1:key1:corrupted-bytes-of-some-length"), ModRevision: 7},
	}
	acks := Acknowledgements{acked: {UnreadableObject: UnreadableObject{ModRevision: 6}}, ghost: {UnreadableObject: UnreadableObject{ModRevision: 1}}} // ghost's is of an older value
	src := FromSet(next)
	newTallyOf := func(decryptCheck bool) *tally {
		return newTally(res, newClassifier(src.Rule(secrets), src.KnownPrefixes()), acks, decryptCheck)
	}

	withoutCheck := newTallyOf(false)
	for _, kv := range kvs {
		withoutCheck.add(kv, checkResult{})
	}
	ri := withoutCheck.inventory(42)
	if ri.Objects != 6 || ri.Revision != 42 || ri.WritePrefix != "k8s:enc:aesgcm:v1:key2:" {
		t.Fatalf("inventory = %+v, want 6 objects at revision 42 written with key2", ri)
	}
	// The corrupted value carries key1's prefix: without decrypting it is stale, not unreadable.
	if ri.Stale != 3 || ri.Plaintext != 1 || ri.Unreadable != 2 || ri.Acknowledged != 1 {
		t.Errorf("stale %d, plaintext %d, unreadable %d, acknowledged %d; want 3, 1, 2, 1", ri.Stale, ri.Plaintext, ri.Unreadable, ri.Acknowledged)
	}
	if got := bucketCount(ri, "k8s:enc:aesgcm:v1:key1:", true); got != 2 {
		t.Errorf("stale key1 objects %d, want 2", got)
	}
	if got := bucketCount(ri, "k8s:enc:aesgcm:v1:key2:", false); got != 1 {
		t.Errorf("current key2 objects %d, want 1", got)
	}
	if len(ri.UnreadableObjects) != 2 || ri.UnreadableObjects[0].Key != ghost || ri.UnreadableObjects[0].Acknowledged ||
		ri.UnreadableObjects[1].Key != acked || !ri.UnreadableObjects[1].Acknowledged || ri.UnreadableObjects[1].Name != "acked" {
		t.Errorf("unreadable objects %+v, want ghost (not acknowledged: another revision) then acked (acknowledged)", ri.UnreadableObjects)
	}
	for i := 1; i < len(ri.Buckets); i++ {
		if a, b := ri.Buckets[i-1], ri.Buckets[i]; a.Prefix > b.Prefix {
			t.Errorf("buckets out of order: %q before %q", a.Prefix, b.Prefix)
		}
	}

	tr := next.TransformerFor(secrets)
	withCheck := newTallyOf(true)
	for _, kv := range kvs {
		withCheck.add(kv, checkOne(ctx, tr, kv.Key, kv.Value))
	}
	ri = withCheck.inventory(42)
	if ri.Stale != 2 || ri.Unreadable != 3 || ri.Acknowledged != 1 {
		t.Errorf("with the decrypt check: stale %d, unreadable %d, acknowledged %d; want 2, 3, 1", ri.Stale, ri.Unreadable, ri.Acknowledged)
	}
	if n := len(ri.UnreadableObjects); n != 3 || ri.UnreadableObjects[2].Key != corrupt {
		t.Errorf("with the decrypt check the unreadable objects are %+v, want the corrupted one last", ri.UnreadableObjects)
	}
}
