package kmsv2

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"k8s.io/component-base/metrics"
	kmsapi "k8s.io/kms/apis/v2"
	"k8s.io/kms/pkg/service"

	"github.com/rekey-io/rekey/internal/kmsplugin"
)

// misbehaving is the local plugin behind switches that make it answer wrongly.
type misbehaving struct {
	*kmsplugin.Plugin
	// bigDecrypt answers every Decrypt with a plaintext of almost 4 MiB (the gRPC limit).
	bigDecrypt atomic.Bool
	// newKeyIDs answers every Status with a key id never seen before.
	newKeyIDs atomic.Bool
	statusN   atomic.Int64
	decrypts  atomic.Int64
}

func (m *misbehaving) Status(ctx context.Context) (*service.StatusResponse, error) {
	r, err := m.Plugin.Status(ctx)
	if err == nil && m.newKeyIDs.Load() {
		r.KeyID = fmt.Sprintf("rotating-key-%d", m.statusN.Add(1))
	}
	return r, err
}

func (m *misbehaving) Decrypt(ctx context.Context, uid string, req *service.DecryptRequest) ([]byte, error) {
	m.decrypts.Add(1)
	if m.bigDecrypt.Load() {
		return bytes.Repeat([]byte{0x42}, 4<<20-64<<10), nil
	}
	return m.Plugin.Decrypt(ctx, uid, req)
}

// startMisbehaving serves a misbehaving plugin over a real unix socket.
func startMisbehaving(tb testing.TB) (*misbehaving, string) {
	tb.Helper()
	tp := &testPlugin{}
	dir, err := os.MkdirTemp("", "kms")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	tp.keysFile = filepath.Join(dir, "keys.yaml")
	tp.writeKeys(tb, "key-1")
	p, err := kmsplugin.NewPlugin(tp.keysFile)
	if err != nil {
		tb.Fatal(err)
	}
	m := &misbehaving{Plugin: p}
	sock := filepath.Join(dir, "p.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		tb.Fatal(err)
	}
	gs := grpc.NewServer()
	kmsapi.RegisterKeyManagementServiceServer(gs, service.NewGRPCService(sock, 0, m))
	go func() { _ = gs.Serve(lis) }()
	tb.Cleanup(gs.Stop)
	return m, "unix://" + sock
}

// TestOversizedDecryptRepliesAreRefusedAndNotCached: a DEK seed is exactly 32 bytes. A
// plugin answering Decrypt with 4 MiB must get an error, and its reply must not be
// cached (1,024 such entries would hold 4 GiB).
func TestOversizedDecryptRepliesAreRefusedAndNotCached(t *testing.T) {
	m, endpoint := startMisbehaving(t)
	writer := newProvider(t, "kms1", endpoint, FactoryOptions{})
	v := sealOpen(t, writer, []byte("payload"))
	reader := newProvider(t, "kms1", endpoint, FactoryOptions{})
	m.bigDecrypt.Store(true)
	before, cached := m.decrypts.Load(), reader.dek.len() // the reader's own write seed

	for i := 0; i < 3; i++ {
		_, _, err := reader.Open(context.Background(), v[len(reader.Prefix()):], aad)
		if err == nil || !strings.Contains(err.Error(), "invalid seed length") {
			t.Fatalf("read %d with a 4 MiB seed: err = %v, want an invalid seed length error", i, err)
		}
		if len(err.Error()) > 1024 {
			t.Fatalf("error is %d bytes long", len(err.Error()))
		}
	}
	if n := reader.dek.len(); n != cached {
		t.Fatalf("the DEK cache holds %d entries after refused replies, %d before", n, cached)
	}
	if got := m.decrypts.Load() - before; got != 3 {
		t.Fatalf("%d Decrypt calls for 3 reads; a refused reply must not be served from cache", got)
	}
	// Healthy again: the same value reads.
	m.bigDecrypt.Store(false)
	if out, _, err := reader.Open(context.Background(), v[len(reader.Prefix()):], aad); err != nil || string(out) != "payload" {
		t.Fatalf("after the plugin recovered: %q, %v", out, err)
	}
}

// TestKeyIDHashSeriesAreBounded: a plugin returning a new key id on every Status must
// not grow apiserver_envelope_encryption_key_id_hash_status_last_timestamp_seconds
// without bound.
func TestKeyIDHashSeriesAreBounded(t *testing.T) {
	m, endpoint := startMisbehaving(t)
	reg := metrics.NewKubeRegistry()
	newProvider(t, "kms1", endpoint, FactoryOptions{Registry: reg, StatusInterval: time.Millisecond, RetryInterval: time.Millisecond})
	m.newKeyIDs.Store(true)
	deadline := time.Now().Add(20 * time.Second)
	for m.statusN.Load() < 3*maxKeyIDHashSeries && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := m.statusN.Load(); n < 3*maxKeyIDHashSeries {
		t.Fatalf("only %d Status calls with new key ids", n)
	}
	series := countSeries(t, reg, "apiserver_envelope_encryption_key_id_hash_status_last_timestamp_seconds")
	if series == 0 || series > maxKeyIDHashSeries {
		t.Fatalf("%d key id hash series after %d distinct key ids; want 1..%d", series, m.statusN.Load(), maxKeyIDHashSeries)
	}
	t.Logf("%d distinct key ids from Status → %d series", m.statusN.Load(), series)
}

func countSeries(t *testing.T, reg metrics.KubeRegistry, name string) int {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return len(mf.GetMetric())
		}
	}
	return 0
}
