package kmsv2

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"k8s.io/apiserver/pkg/storage/value"
	kmstypes "k8s.io/apiserver/pkg/storage/value/encrypt/envelope/kmsv2/v2"
	"k8s.io/component-base/metrics"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/rekey-io/rekey/internal/kmsplugin"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
)

// aad is converted to the interface once, so benchmarks measure the transformers only.
var aad value.Context = value.DefaultContext("/registry/secrets/ns/name")

func sealOpen(t *testing.T, p *Provider, pt []byte) (stored []byte) {
	t.Helper()
	stored, err := p.Seal(context.Background(), pt, aad)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(stored, p.Prefix()) {
		t.Fatalf("stored value lacks the prefix %q", p.Prefix())
	}
	got, stale, err := p.Open(context.Background(), stored[len(p.Prefix()):], aad)
	if err != nil || stale || !bytes.Equal(got, pt) {
		t.Fatalf("Open = %q, stale %v, %v; want the plaintext, not stale", got, stale, err)
	}
	return stored
}

func TestSealOpenAndWireCompatibility(t *testing.T) {
	tp := startPlugin(t, "key-1")
	tp.SetFaults(kmsplugin.Faults{Annotations: map[string]string{"version.kms.example.com": "1", "a.example.com": "x"}})
	p := newProvider(t, "kms1", tp.endpoint, FactoryOptions{})
	if got := string(p.Prefix()); got != "k8s:enc:kms:v2:kms1:" {
		t.Fatalf("prefix %q", got)
	}
	for _, n := range []int{0, 1, 256, 4096, 65536} {
		pt := bytes.Repeat([]byte{'p'}, n)
		stored := sealOpen(t, p, pt)
		// kube-apiserver's own protobuf type decodes and validates what we wrote.
		var o kmstypes.EncryptedObject
		if err := proto.Unmarshal(stored[len(p.Prefix()):], &o); err != nil {
			t.Fatalf("upstream cannot decode our value: %v", err)
		}
		if o.KeyID != "key-1" || o.EncryptedDEKSourceType != kmstypes.EncryptedDEKSourceType_HKDF_SHA256_XNONCE_AES_GCM_SEED ||
			len(o.EncryptedData) != 32+12+n+16 || len(o.Annotations) != 2 || string(o.Annotations["version.kms.example.com"]) != "1" {
			t.Fatalf("decoded object %+v", &o)
		}
		// Re-marshalling with upstream (deterministic map order) gives our bytes: same
		// fields, same order.
		re, err := proto.MarshalOptions{Deterministic: true}.Marshal(&o)
		if err != nil || !bytes.Equal(re, stored[len(p.Prefix()):]) {
			t.Fatalf("our encoding differs from proto.Marshal (%v)", err)
		}
	}
	// Same etcd key, other AAD: fails.
	stored := sealOpen(t, p, []byte("secret"))
	if _, _, err := p.Open(context.Background(), stored[len(p.Prefix()):], value.DefaultContext("/registry/secrets/ns/other")); err == nil ||
		!strings.Contains(err.Error(), "moved from another etcd key") {
		t.Fatalf("value moved to another key: err %v", err)
	}
	if st := tp.Stats(); st.Encrypt != 1 || st.Decrypt != 0 {
		t.Fatalf("plugin calls %+v: want one Encrypt (the seed) and no Decrypt", st)
	}
}

func TestNonceUniquenessAndGenerationRollover(t *testing.T) {
	tp := startPlugin(t, "key-1")
	p := newProvider(t, "kms1", tp.endpoint, FactoryOptions{WritesPerGeneration: 100})
	seen := map[string]bool{}
	infos := map[string]bool{}
	for i := 0; i < 1000; i++ {
		stored := sealOpen(t, p, []byte("x"))
		var o kmstypes.EncryptedObject
		if err := proto.Unmarshal(stored[len(p.Prefix()):], &o); err != nil {
			t.Fatal(err)
		}
		in := string(o.EncryptedData[:44])
		if seen[in] {
			t.Fatalf("write %d reused an (info, nonce) pair", i)
		}
		seen[in] = true
		infos[string(o.EncryptedData[:32])] = true
		if bytes.Equal(o.EncryptedData[32:36], []byte{0, 0, 0, 0}) && i == 0 {
			t.Log("random nonce prefix is zero (1 in 2^32)")
		}
	}
	if len(infos) != 10 {
		t.Fatalf("%d derived keys for 1000 writes at 100 per generation, want 10", len(infos))
	}
	if st := tp.Stats(); st.Encrypt != 1 {
		t.Fatalf("%d Encrypt calls: generations must not call the plugin", st.Encrypt)
	}
}

func TestReadsNeedOnlyDecrypt(t *testing.T) {
	tp := startPlugin(t, "key-1")
	writer := newProvider(t, "kms1", tp.endpoint, FactoryOptions{})
	stored := sealOpen(t, writer, []byte("hello"))

	// A fresh reader whose plugin Status is unhealthy from the start: it never gets a
	// write seed, yet reads work through Decrypt alone.
	tp.SetFaults(kmsplugin.Faults{StatusHealthz: "sick"})
	r, err := New(kmsConfig("kms1", tp.endpoint), transformers.Options{}, FactoryOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	got, stale, err := r.Open(context.Background(), stored[len(r.Prefix()):], aad)
	if err != nil || string(got) != "hello" || stale {
		t.Fatalf("read before any healthy Status: %q stale=%v err=%v", got, stale, err)
	}
	if _, err := r.Seal(context.Background(), []byte("x"), aad); err == nil || !strings.Contains(err.Error(), "cannot write yet") {
		t.Fatalf("write without a seed: %v", err)
	}
	// Cached now: reads keep working with the plugin gone.
	tp.Stop()
	for i := 0; i < 3; i++ {
		if _, _, err := r.Open(context.Background(), stored[len(r.Prefix()):], aad); err != nil {
			t.Fatalf("cached read with the plugin down: %v", err)
		}
	}
	if st := tp.Stats(); st.Decrypt != 1 {
		t.Fatalf("%d Decrypt calls, want 1", st.Decrypt)
	}
	// Check reports the problem.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := r.Check(ctx); err == nil {
		t.Fatal("Check passed with the plugin unhealthy and then gone")
	}
}

func TestMalformedValuesNeverCallThePlugin(t *testing.T) {
	tp := startPlugin(t, "key-1")
	p := newProvider(t, "kms1", tp.endpoint, FactoryOptions{})
	good := sealOpen(t, p, []byte("hello"))[len(p.Prefix()):]
	// A fresh reader has nothing cached: any plugin call would show in the stats.
	r := newProvider(t, "kms1", tp.endpoint, FactoryOptions{})
	before := tp.Stats().Decrypt
	cases := map[string][]byte{
		"empty":          {},
		"truncated":      good[:len(good)/2],
		"bad tag":        {0xff, 0xff, 0xff},
		"unknown type":   append(append([]byte{}, good...), 0x28, 0x07),
		"negative type":  append(append([]byte{}, good...), 0x28, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01),
		"wrong wiretype": {0x08, 0x01},
		"no key id":      {0x0a, 0x01, 0x00, 0x1a, 0x01, 0x00},
		"huge key id":    append([]byte{0x0a, 0x01, 0x00, 0x1a, 0x01, 0x00, 0x12, 0x81, 0x08}, bytes.Repeat([]byte{'k'}, 1025)...),
		"huge dek":       append([]byte{0x0a, 0x01, 0x00, 0x12, 0x01, 'k', 0x1a, 0x81, 0x08}, bytes.Repeat([]byte{'k'}, 1025)...),
		"bad annotation": {0x0a, 0x01, 0x00, 0x12, 0x01, 'k', 0x1a, 0x01, 0x00, 0x22, 0x07, 0x0a, 0x05, 'p', 'a', 'n', 'd', 'a'},
		"dup annotation": {0x0a, 0x01, 0x00, 0x12, 0x01, 'k', 0x1a, 0x01, 0x00, 0x22, 0x05, 0x0a, 0x03, 'a', '.', 'b', 0x22, 0x05, 0x0a, 0x03, 'a', '.', 'b'},
		"no data":        {0x12, 0x01, 'k', 0x1a, 0x01, 0x00},
	}
	for name, v := range cases {
		if _, _, err := r.Open(context.Background(), v, aad); err == nil {
			t.Errorf("%s: accepted", name)
		} else if !strings.Contains(err.Error(), "kms v2") {
			t.Errorf("%s: error does not say what failed: %v", name, err)
		}
	}
	// Bit flips anywhere in the payload fail authentication or validation; flips in
	// the DEK source may reach the plugin, which must refuse them.
	for i := 0; i < len(good); i++ {
		flipped := append([]byte{}, good...)
		flipped[i] ^= 0x04
		if got, _, err := r.Open(context.Background(), flipped, aad); err == nil {
			t.Fatalf("bit flip at byte %d accepted: %q", i, got)
		}
	}
	if after := tp.Stats().Decrypt; after-before > int64(len(good)) {
		t.Fatalf("%d Decrypt calls", after-before)
	}
}

// Cache poisoning (upstream TestCacheNotCorrupted): a plugin that returns a constant
// ciphertext and carries the real wrapped key in annotations.
func TestCacheKeyIncludesAnnotations(t *testing.T) {
	tp := startPlugin(t, "key-1")
	tp.SetFaults(kmsplugin.Faults{Annotations: map[string]string{"gen.example.com": "1"}})
	p1 := newProvider(t, "kms1", tp.endpoint, FactoryOptions{})
	v1 := sealOpen(t, p1, []byte("one"))
	tp.SetFaults(kmsplugin.Faults{Annotations: map[string]string{"gen.example.com": "2"}})
	p2 := newProvider(t, "kms1", tp.endpoint, FactoryOptions{})
	v2 := sealOpen(t, p2, []byte("two"))
	// Swap the annotations between the two values: each then names the other's cache
	// entry only if annotations were ignored.
	reader := newProvider(t, "kms1", tp.endpoint, FactoryOptions{})
	for _, v := range [][]byte{v1, v2} {
		if _, _, err := reader.Open(context.Background(), v[len(reader.Prefix()):], aad); err != nil {
			t.Fatal(err)
		}
	}
	if n := reader.dek.len(); n != 3 { // its own seed + two foreign
		t.Fatalf("cache holds %d DEK sources, want 3", n)
	}
	// Same encrypted DEK source, other annotations: a different identity, so a miss
	// that goes to the plugin, never a hit on the first value's entry.
	var o kmstypes.EncryptedObject
	_ = proto.Unmarshal(v1[len(p1.Prefix()):], &o)
	o.Annotations = map[string][]byte{"gen.example.com": []byte("2")}
	forged, _ := proto.Marshal(&o)
	before := tp.Stats().Decrypt
	if _, _, err := reader.Open(context.Background(), forged, aad); err != nil {
		t.Fatal(err)
	}
	if tp.Stats().Decrypt != before+1 || reader.dek.len() != 4 {
		t.Fatal("a value with other annotations was served from another value's cache entry")
	}
}

func TestDEKCacheIsBounded(t *testing.T) {
	tp := startPlugin(t, "key-1")
	reader := newProvider(t, "kms1", tp.endpoint, FactoryOptions{DEKCacheEntries: 4})
	for i := 0; i < 10; i++ {
		w := newProvider(t, "kms1", tp.endpoint, FactoryOptions{})
		v := sealOpen(t, w, []byte("x"))
		if _, _, err := reader.Open(context.Background(), v[len(reader.Prefix()):], aad); err != nil {
			t.Fatal(err)
		}
		w.Close()
	}
	if n := reader.dek.len(); n != 4 {
		t.Fatalf("cache holds %d entries, bound is 4", n)
	}
}

func TestKeyRotationMakesOldValuesStale(t *testing.T) {
	tp := startPlugin(t, "key-1")
	p := newProvider(t, "kms1", tp.endpoint, FactoryOptions{HealthyTTL: time.Nanosecond})
	old := sealOpen(t, p, []byte("old"))
	tp.writeKeys(t, "key-2", "key-1")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	// Two Statuses: the first reports key-2 as a candidate, the second confirms it
	// (DefaultKeyIDConfirmations).
	for range DefaultKeyIDConfirmations {
		if err := p.Check(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if st := p.Status(); st.KeyIDHash != state.KeyIDHash("key-2") || !st.Healthy {
		t.Fatalf("status after rotation %+v", st)
	}
	got, stale, err := p.Open(ctx, old[len(p.Prefix()):], aad)
	if err != nil || !stale || string(got) != "old" {
		t.Fatalf("old value after rotation: %q stale=%v err=%v; want readable and stale", got, stale, err)
	}
	sealOpen(t, p, []byte("new"))
}

func TestWritesStopThreeMinutesAfterLastHealthyStatus(t *testing.T) {
	tp := startPlugin(t, "key-1")
	clk := testingclock.NewFakeClock(time.Now())
	p := newProviderWith(t, "kms1", tp.endpoint, transformers.Options{Clock: clk}, FactoryOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stored := sealOpen(t, p, []byte("a"))
	tp.SetFaults(kmsplugin.Faults{StatusHealthz: "sick"})
	clk.Step(2 * time.Minute)
	if err := p.Check(ctx); err == nil || !strings.Contains(err.Error(), "sick") {
		t.Fatalf("Check with an unhealthy plugin: %v", err)
	}
	sealOpen(t, p, []byte("still within 3 minutes"))
	clk.Step(61 * time.Second)
	if _, err := p.Seal(ctx, []byte("b"), aad); err == nil || !strings.Contains(err.Error(), "expired") || strings.Contains(err.Error(), "key-1") ||
		!errors.Is(err, transformers.ErrKMSUnavailable) {
		t.Fatalf("write 3m1s after the last healthy Status: %v (want an expiry error matching transformers.ErrKMSUnavailable)", err)
	}
	if got, _, err := p.Open(ctx, stored[len(p.Prefix()):], aad); err != nil || string(got) != "a" {
		t.Fatalf("reads must not depend on plugin health: %v", err)
	}
	tp.SetFaults(kmsplugin.Faults{})
	clk.Step(4 * time.Second) // past the 3 s unhealthy cache
	if err := p.Check(ctx); err != nil {
		t.Fatal(err)
	}
	sealOpen(t, p, []byte("recovered"))
	if st := tp.Stats(); st.Encrypt != 1 {
		t.Fatalf("%d Encrypt calls; recovery with the same key id must reuse the seed", st.Encrypt)
	}
}

func TestPluginRestartAndAbstractSocket(t *testing.T) {
	dir := startPlugin(t, "key-1").dir
	abstract := "unix:///@rekey-test-" + strings.ReplaceAll(dir[len(dir)-8:], "/", "")
	s, err := kmsplugin.Start(kmsplugin.Options{ListenAddr: abstract, KeysFile: dir + "/keys.yaml"})
	if err != nil {
		t.Fatal(err)
	}
	p := newProvider(t, "kms1", abstract, FactoryOptions{HealthyTTL: time.Nanosecond, UnhealthyTTL: time.Nanosecond})
	stored := sealOpen(t, p, []byte("x"))
	s.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cctx, ccancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer ccancel()
	if err := p.Check(cctx); err == nil {
		t.Fatal("Check passed with the plugin stopped")
	}
	s, err = kmsplugin.Start(kmsplugin.Options{ListenAddr: abstract, KeysFile: dir + "/keys.yaml"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	for {
		if err := p.Check(ctx); err == nil {
			break
		} else if ctx.Err() != nil {
			t.Fatalf("no recovery after the plugin restarted: %v", err)
		}
	}
	// A cache-missing read after the restart goes through the new connection.
	r := newProvider(t, "kms1", abstract, FactoryOptions{})
	if _, _, err := r.Open(ctx, stored[len(r.Prefix()):], aad); err != nil {
		t.Fatal(err)
	}
	p.Close()
	p.Close()
	if err := p.WaitReady(ctx); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Fatal("WaitReady on a closed provider succeeded")
	}
}

// TestOnKeyIDChangeReportsEachNewKeyID: the hook hears the first key id and a rotation,
// not the DEK seeds that follow under the same key id.
func TestOnKeyIDChangeReportsEachNewKeyID(t *testing.T) {
	tp := startPlugin(t, "key-1")
	var mu sync.Mutex
	var heard []string
	p := newProvider(t, "kms1", tp.endpoint, FactoryOptions{HealthyTTL: time.Nanosecond,
		OnKeyIDChange: func(provider, hash string) {
			mu.Lock()
			defer mu.Unlock()
			heard = append(heard, provider+" "+hash)
		}})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := p.Check(ctx); err != nil { // a second healthy Status under the same key id
		t.Fatal(err)
	}
	tp.writeKeys(t, "key-2", "key-1")
	for range DefaultKeyIDConfirmations { // a candidate, then confirmed
		if err := p.Check(ctx); err != nil {
			t.Fatal(err)
		}
	}
	// The confirmed key id writes once the Encrypt it asks for answered: the hook hears
	// it when that write state is published, which may be after Check returned.
	heardNow := func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(heard)
	}
	for len(heardNow()) < 2 && ctx.Err() == nil {
		time.Sleep(time.Millisecond)
	}
	// More Statuses under key-2 (new DEK seeds may follow) report nothing new.
	if err := p.Check(ctx); err != nil {
		t.Fatal(err)
	}
	want := []string{"kms1 " + state.KeyIDHash("key-1"), "kms1 " + state.KeyIDHash("key-2")}
	if got := heardNow(); !slices.Equal(got, want) {
		t.Fatalf("OnKeyIDChange heard %q, want %q", got, want)
	}
}

// A Status asked while the plugin was sick and answered after it recovered (and the clock
// moved on) answers for the moment it was asked: it must not pin "sick" in Check's cache.
// CI once failed TestWritesStopThreeMinutesAfterLastHealthyStatus this way when a timer's
// Status straddled the test's recovery.
func TestStatusAnswersForTheMomentItWasAsked(t *testing.T) {
	tp := startPlugin(t, "key-1")
	clk := testingclock.NewFakeClock(time.Now())
	p := newProviderWith(t, "kms1", tp.endpoint, transformers.Options{Clock: clk}, FactoryOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	tp.SetFaults(kmsplugin.Faults{StatusHealthz: "sick", Latency: kmsplugin.Duration{Duration: 500 * time.Millisecond}})
	asked := tp.Stats().Status
	clk.Step(DefaultHealthyTTL + time.Second)
	first := make(chan error, 1)
	go func() { first <- p.Check(ctx) }()
	for tp.Stats().Status == asked {
		if ctx.Err() != nil {
			t.Fatal("no Status reached the plugin")
		}
		time.Sleep(time.Millisecond)
	}
	// The sick answer is still on its way: recover and move past the unhealthy cache.
	tp.SetFaults(kmsplugin.Faults{})
	clk.Step(DefaultUnhealthyTTL + time.Second)
	<-first // sick or healthy, depending on which answer it waited for
	if err := p.Check(ctx); err != nil {
		t.Fatalf("Check after the plugin recovered and the unhealthy cache expired: %v", err)
	}
}

// A provider a reload removed leaves no health or write-expiry series behind (a frozen
// expiry would fire the monitoring pack's "write DEK about to expire" alert forever);
// one a reload keeps (the new Provider opens before the old one closes) keeps them.
func TestClosingTheLastProviderOfANameDeletesItsSeries(t *testing.T) {
	tp := startPlugin(t, "key-1")
	reg := metrics.NewKubeRegistry()
	m := NewMetrics(reg)
	series := func() (healthy, expiry int) {
		return countSeries(t, reg, "rekey_kmsv2_healthy"), countSeries(t, reg, "rekey_kmsv2_write_expiry_timestamp_seconds")
	}
	old := newProviderWith(t, "kms1", tp.endpoint, transformers.Options{}, FactoryOptions{Metrics: m})
	if h, e := series(); h != 1 || e != 1 {
		t.Fatalf("a ready provider: %d healthy and %d write-expiry series, want 1 and 1", h, e)
	}
	kept := newProviderWith(t, "kms1", tp.endpoint, transformers.Options{}, FactoryOptions{Metrics: m})
	old.Close()
	if h, e := series(); h != 1 || e != 1 {
		t.Fatalf("after a reload that keeps kms1: %d healthy and %d write-expiry series, want 1 and 1", h, e)
	}
	kept.Close()
	if h, e := series(); h != 0 || e != 0 {
		t.Fatalf("after a reload that removed kms1: %d healthy and %d write-expiry series, want none", h, e)
	}
}
