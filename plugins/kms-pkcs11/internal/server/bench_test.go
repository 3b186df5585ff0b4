package server_test

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	kmsapi "k8s.io/kms/apis/v2"

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
