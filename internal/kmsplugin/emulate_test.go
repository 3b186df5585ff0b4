package kmsplugin

import (
	"bytes"
	"context"
	"encoding/base64"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/kms/pkg/service"
)

// startEmulated starts a plugin on a keys file of keys a1 and b2 (a1 active) with faults
// active from the start.
func startEmulated(t *testing.T, f Faults) (*Server, string) {
	t.Helper()
	dir := t.TempDir()
	keys := filepath.Join(dir, "keys.yaml")
	writeKeys(t, keys, "a1", "b2")
	s, err := Start(Options{ListenAddr: "unix://" + filepath.Join(dir, "p.sock"), KeysFile: keys, Faults: f})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s, keys
}

func statusKeyID(t *testing.T, p *Plugin) string {
	t.Helper()
	st, err := p.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return st.KeyID
}

func TestStartupFlap(t *testing.T) {
	s, _ := startEmulated(t, Faults{StartupFlap: true})
	if got, want := statusKeyID(t, s.Plugin), StartupKeyURIPrefix+"a1"; got != want {
		t.Fatalf("first Status key id %q, want %q", got, want)
	}
	for i := 0; i < 3; i++ {
		if got := statusKeyID(t, s.Plugin); got != "a1" {
			t.Fatalf("later Status key id %q, want a1", got)
		}
	}
	enc, err := s.Encrypt(context.Background(), "u", []byte("seed"))
	if err != nil || enc.KeyID != "a1" {
		t.Fatalf("Encrypt %v, key id %q; want a1", err, enc.KeyID)
	}
}

func TestStartupFlapSetLateShowsAfterRestartOnly(t *testing.T) {
	s, _ := startEmulated(t, Faults{})
	_ = statusKeyID(t, s.Plugin)
	s.SetFaults(Faults{StartupFlap: true})
	if got := statusKeyID(t, s.Plugin); got != "a1" {
		t.Fatalf("Status after a late StartupFlap reports %q, want a1 (the first Status was before it)", got)
	}
}

func TestDecryptActiveOnly(t *testing.T) {
	s, _ := startEmulated(t, Faults{})
	ctx := context.Background()
	old, err := s.Encrypt(ctx, "u", []byte("seed-a1"))
	if err != nil {
		t.Fatal(err)
	}
	s.SetFaults(Faults{DecryptActiveOnly: true, ActiveKey: "b2"})
	_, err = s.Decrypt(ctx, "u", &service.DecryptRequest{KeyID: old.KeyID, Ciphertext: old.Ciphertext})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("Decrypt of a1 ciphertext with b2 active: %v, want FailedPrecondition", err)
	}
	cur, err := s.Encrypt(ctx, "u", []byte("seed-b2"))
	if err != nil || cur.KeyID != "b2" {
		t.Fatalf("Encrypt %v, key id %q", err, cur.KeyID)
	}
	pt, err := s.Decrypt(ctx, "u", &service.DecryptRequest{KeyID: cur.KeyID, Ciphertext: cur.Ciphertext})
	if err != nil || string(pt) != "seed-b2" {
		t.Fatalf("Decrypt with the current key: %q %v", pt, err)
	}
	// Without the fault every key of the file decrypts again.
	s.SetFaults(Faults{ActiveKey: "b2"})
	if pt, err := s.Decrypt(ctx, "u", &service.DecryptRequest{KeyID: old.KeyID, Ciphertext: old.Ciphertext}); err != nil || string(pt) != "seed-a1" {
		t.Fatalf("Decrypt of a1 ciphertext without the fault: %q %v", pt, err)
	}
}

func TestFixedKeyIDHidesRotation(t *testing.T) {
	const arn = "arn:aws:kms:eu-west-1:111122223333:key/fixed"
	s, keys := startEmulated(t, Faults{FixedKeyID: arn})
	ctx := context.Background()
	before, err := s.Encrypt(ctx, "u", []byte("before"))
	if err != nil || before.KeyID != arn {
		t.Fatalf("Encrypt %v, key id %q, want the fixed id", err, before.KeyID)
	}
	writeKeys(t, keys, "b2", "a1")
	if got := statusKeyID(t, s.Plugin); got != arn {
		t.Fatalf("Status after a rotation reports %q, want the fixed id", got)
	}
	after, err := s.Encrypt(ctx, "u", []byte("after"))
	if err != nil || after.KeyID != arn {
		t.Fatalf("Encrypt %v, key id %q", err, after.KeyID)
	}
	for want, enc := range map[string]*service.EncryptResponse{"before": before, "after": after} {
		pt, err := s.Decrypt(ctx, "u", &service.DecryptRequest{KeyID: enc.KeyID, Ciphertext: enc.Ciphertext})
		if err != nil || string(pt) != want {
			t.Fatalf("Decrypt of %q: %q %v", want, pt, err)
		}
	}
}

func TestActiveKeyReturnsToAnEarlierID(t *testing.T) {
	s, _ := startEmulated(t, Faults{})
	var seen []string
	for _, k := range []string{"", "b2", "a1"} {
		s.SetFaults(Faults{ActiveKey: k})
		seen = append(seen, statusKeyID(t, s.Plugin))
	}
	if seen[0] != "a1" || seen[1] != "b2" || seen[2] != "a1" {
		t.Fatalf("key ids %v, want [a1 b2 a1]", seen)
	}
	s.SetFaults(Faults{ActiveKey: "c3"})
	if _, err := s.Status(context.Background()); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("Status with an active key not in the file: %v, want FailedPrecondition", err)
	}
}

// A key id reused with other material: the keys file names a1 again with a new secret;
// what a1 sealed before no longer opens.
func TestKeyIDReusedWithOtherMaterial(t *testing.T) {
	s, keys := startEmulated(t, Faults{})
	ctx := context.Background()
	old, err := s.Encrypt(ctx, "u", []byte("seed"))
	if err != nil {
		t.Fatal(err)
	}
	writeKeys(t, keys, "b2")
	if got := statusKeyID(t, s.Plugin); got != "b2" {
		t.Fatalf("key id %q, want b2", got)
	}
	other := base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{'z'}, 32))
	if err := os.WriteFile(keys, []byte("keys:\n- name: a1\n  secret: "+other+"\n- name: b2\n  secret: "+base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{'b'}, 32))+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := statusKeyID(t, s.Plugin); got != "a1" {
		t.Fatalf("key id %q, want a1 again", got)
	}
	if _, err := s.Decrypt(ctx, "u", &service.DecryptRequest{KeyID: old.KeyID, Ciphertext: old.Ciphertext}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("Decrypt of the first a1's ciphertext: %v, want InvalidArgument", err)
	}
}

func TestEmulatedFaultsThroughControlAPI(t *testing.T) {
	dir := t.TempDir()
	keys := filepath.Join(dir, "keys.yaml")
	writeKeys(t, keys, "a1", "b2")
	s, err := Start(Options{ListenAddr: "unix://" + filepath.Join(dir, "p.sock"), KeysFile: keys, ControlAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	body := `{"startupFlap":true,"decryptActiveOnly":true,"fixedKeyID":"fixed","activeKey":"b2"}`
	req, _ := http.NewRequest(http.MethodPut, "http://"+s.ControlAddr()+"/faults", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("PUT /faults: %s", resp.Status)
	}
	want := Faults{StartupFlap: true, DecryptActiveOnly: true, FixedKeyID: "fixed", ActiveKey: "b2"}
	if got := s.Faults(); got.StartupFlap != want.StartupFlap || got.DecryptActiveOnly != want.DecryptActiveOnly || got.FixedKeyID != want.FixedKeyID || got.ActiveKey != want.ActiveKey {
		t.Fatalf("faults %+v, want %+v", got, want)
	}
}
