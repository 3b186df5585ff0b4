package server_test

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"fmt"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"k8s.io/apiserver/pkg/storage/value"
	kmsapi "k8s.io/kms/apis/v2"

	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
	"github.com/rekey-io/rekey/plugins/kms-pkcs11/internal/softhsmtest"
)

// seedSize is what a KMS v2 Encrypt wraps: rekey's and upstream's DEK seed.
const seedSize = 32

// BenchmarkSealOpen: one seal and one open of a 32-byte DEK seed per op, AES-256-GCM
// on the SoftHSM2 token (crypto11) against crypto/aes in the process (the floor), in
// the same run.
//
//	go test -run '^$' -bench SealOpen -benchtime 3s ./internal/server
func BenchmarkSealOpen(b *testing.B) {
	h := softhsmtest.New(b)
	adm := adminB(b, h)
	if _, err := adm.Rotate(time.Now()); err != nil {
		b.Fatal(err)
	}
	hsm, err := adm.AEAD(1)
	if err != nil {
		b.Fatal(err)
	}
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	blk, _ := aes.NewCipher(key)
	inproc, _ := cipher.NewGCM(blk)
	for _, c := range []struct {
		name string
		a    cipher.AEAD
	}{{"impl=softhsm2", hsm}, {"impl=crypto-aes", inproc}} {
		b.Run(c.name, func(b *testing.B) {
			pt := make([]byte, seedSize)
			nonce := make([]byte, 12)
			ad := []byte("kek:v1")
			b.ReportAllocs()
			for b.Loop() {
				ct := c.a.Seal(nil, nonce, pt, ad)
				if _, err := c.a.Open(nil, nonce, ct, ad); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkGRPC: KMS v2 Encrypt and Decrypt of a 32-byte seed over the unix socket,
// one caller; reports each call's p50 and p99.
//
//	go test -run '^$' -bench GRPC -benchtime 3s ./internal/server
func BenchmarkGRPC(b *testing.B) {
	h := softhsmtest.New(b)
	adm := adminB(b, h)
	if _, err := adm.Rotate(time.Now()); err != nil {
		b.Fatal(err)
	}
	p := startPluginB(b, h)
	conn, err := grpc.NewClient(p.endpoint, grpc.WithTransportCredentials(insecureCreds()), grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", strings.TrimPrefix(a, "unix://"))
	}))
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	c := kmsapi.NewKeyManagementServiceClient(conn)
	ctx := context.Background()
	seed := make([]byte, seedSize)
	var enc, dec []time.Duration
	for b.Loop() {
		t0 := time.Now()
		r, err := c.Encrypt(ctx, &kmsapi.EncryptRequest{Plaintext: seed, Uid: "u"})
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if _, err := c.Decrypt(ctx, &kmsapi.DecryptRequest{Ciphertext: r.Ciphertext, KeyId: r.KeyId, Uid: "u"}); err != nil {
			b.Fatal(err)
		}
		enc, dec = append(enc, t1.Sub(t0)), append(dec, time.Since(t1))
	}
	for _, m := range []struct {
		name string
		d    []time.Duration
	}{{"encrypt", enc}, {"decrypt", dec}} {
		slices.Sort(m.d)
		b.ReportMetric(float64(m.d[len(m.d)/2].Microseconds()), m.name+"-p50-µs")
		b.ReportMetric(float64(m.d[len(m.d)*99/100].Microseconds()), m.name+"-p99-µs")
	}
}

// BenchmarkColdRead: 10,000 values written by rekey's transformer, 1,000 under each
// of 10 key versions (a rotation between each thousand), then read by a transformer
// with an empty DEK cache (a restarted apiserver): rekey's and upstream's, each built
// anew per op. Reports the plugin's Decrypt calls per op (one per DEK seed the reader
// meets: the versions' seeds, not the objects).
//
//	go test -run '^$' -bench ColdRead -benchtime 3x ./internal/server
func BenchmarkColdRead(b *testing.B) {
	const versions, perVersion = 10, 1000
	h := softhsmtest.New(b)
	adm := adminB(b, h)
	if _, err := adm.Rotate(time.Now()); err != nil {
		b.Fatal(err)
	}
	p := startPluginB(b, h)
	w, wp := oursB(b, p, "cold-writer")
	ctx := context.Background()
	var stored [][]byte
	for v := 1; v <= versions; v++ {
		if v > 1 {
			if _, err := adm.Rotate(time.Now()); err != nil {
				b.Fatal(err)
			}
			for range kmsv2.DefaultKeyIDConfirmations + 1 {
				if err := wp.Check(ctx); err != nil {
					b.Fatal(err)
				}
			}
		}
		for i := range perVersion {
			out, err := w.TransformToStorage(ctx, []byte(fmt.Sprintf("secret-%d-%d", v, i)), aad)
			if err != nil {
				b.Fatal(err)
			}
			stored = append(stored, out)
		}
	}
	if got := wp.WriteKeyIDHash(); got != hashOf(fmt.Sprintf("kek:v%d", versions)) {
		b.Fatalf("the writer ended under %s, not under version %d", got, versions)
	}
	for _, impl := range []string{"rekey", "upstream"} {
		b.Run("impl="+impl, func(b *testing.B) {
			var decrypts float64
			for b.Loop() {
				b.StopTimer()
				var r value.Transformer
				if impl == "rekey" {
					r, _ = oursB(b, p, "cold-writer")
				} else {
					r = upstreamB(b, p, "cold-writer")
				}
				before := p.decrypts(b)
				b.StartTimer()
				for _, s := range stored {
					if _, _, err := r.TransformFromStorage(ctx, s, aad); err != nil {
						b.Fatal(err)
					}
				}
				b.StopTimer()
				decrypts += p.decrypts(b) - before
				b.StartTimer()
			}
			b.ReportMetric(decrypts/float64(b.N), "decrypt-calls/op")
		})
	}
}
