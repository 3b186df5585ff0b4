package evidence

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"strings"
	"testing"
	"time"
)

func samplePredicate() *Predicate {
	return &Predicate{
		Cluster:  Cluster{ID: "ABCDEFGHIJKLMNOPQRSTUVWXYZ", EtcdPrefix: "/registry", CoordinationPrefix: "/rekey"},
		Revision: 1234567, TakenAt: time.Date(2026, 11, 28, 6, 0, 0, 0, time.UTC), RekeyVersion: "v0.0.0-test", FIPS: true,
		ConfigHash: "sha256:00ff", APIServers: []APIServer{{ID: "a", ConfigHash: "sha256:00ff", SameConfig: true}},
		Resources: []Resource{{
			Resource: "secrets", WriteKey: "aesgcm/key2 check:0011223344556677", Objects: 12, Plaintext: 1, Stale: 1, Unreadable: 1,
			Keys: []Key{
				{Fingerprint: "aesgcm/key1 (not in configuration)", Provider: "aesgcm", Name: "key1", Objects: 1, Unreadable: 1},
				{Fingerprint: "aesgcm/key2 check:0011223344556677", Provider: "aesgcm", Name: "key2", Check: "0011223344556677", InConfiguration: true, Current: true, Objects: 10},
				{Fingerprint: "identity", Provider: "identity", InConfiguration: true, Objects: 1},
			},
		}},
		Totals: Totals{Objects: 12, Plaintext: 1, Stale: 1, Unreadable: 1, NotOnWriteKey: 2},
	}
}

func pemKeys(t *testing.T, priv crypto.Signer) (privPEM, pubPEM []byte) {
	t.Helper()
	der, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	pubDER, err := x509.MarshalPKIXPublicKey(priv.Public())
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER})
}

func keys(t *testing.T) map[string]crypto.Signer {
	_, ed, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	ec, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return map[string]crypto.Signer{"ed25519": ed, "ecdsa-p256": ec}
}

// Every byte of the envelope matters: each one changed fails verification, as does
// another key of the same kind; the original verifies and round-trips the predicate.
func TestSignVerify(t *testing.T) {
	ctx := context.Background()
	other := keys(t)
	for name, key := range keys(t) {
		t.Run(name, func(t *testing.T) {
			privPEM, pubPEM := pemKeys(t, key)
			signer, err := ParsePrivateKey(privPEM)
			if err != nil {
				t.Fatal(err)
			}
			pub, err := ParsePublicKey(pubPEM)
			if err != nil {
				t.Fatal(err)
			}
			p := samplePredicate()
			file, err := Sign(ctx, p, signer)
			if err != nil {
				t.Fatal(err)
			}
			v, err := Verify(ctx, file, pub)
			if err != nil {
				t.Fatalf("verify: %v\n%s", err, file)
			}
			want, _ := p.Digest()
			if v.Digest != want || v.Subject != p.Cluster.ID || v.Predicate.Totals != p.Totals || v.Predicate.Resources[0].Keys[1].Check != "0011223344556677" {
				t.Fatalf("verified %+v, want digest %s and the predicate back", v, want)
			}
			if _, err := Verify(ctx, file, other[name].Public()); err == nil || !strings.Contains(err.Error(), "not by the public key given") {
				t.Fatalf("another %s key: err = %v", name, err)
			}
			for i := range file {
				changed := bytes.Clone(file)
				changed[i] ^= 0x01
				if _, err := Verify(ctx, changed, pub); err == nil {
					t.Fatalf("byte %d (%q → %q) changed and the envelope still verifies", i, file[i], changed[i])
				}
			}
			// A signature made over another predicate does not verify this one.
			p2 := samplePredicate()
			p2.Totals.Plaintext = 0
			file2, err := Sign(ctx, p2, signer)
			if err != nil {
				t.Fatal(err)
			}
			if bytes.Equal(file, file2) {
				t.Fatal("two predicates gave one envelope")
			}
		})
	}
}

func TestParseKeys(t *testing.T) {
	rsaLike := pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: []byte{1, 2, 3}})
	if _, err := ParsePrivateKey(rsaLike); err == nil || !strings.Contains(err.Error(), "PKCS#8") {
		t.Fatalf("RSA PEM: %v", err)
	}
	p384, err := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	privPEM, pubPEM := pemKeys(t, p384)
	if _, err := ParsePrivateKey(privPEM); err == nil || !strings.Contains(err.Error(), "P-384") {
		t.Fatalf("P-384 private key: %v", err)
	}
	if _, err := ParsePublicKey(pubPEM); err == nil || !strings.Contains(err.Error(), "P-384") {
		t.Fatalf("P-384 public key: %v", err)
	}
	if _, err := ParsePublicKey(privPEM); err == nil {
		t.Fatal("a private key PEM was taken for a public key")
	}
}
