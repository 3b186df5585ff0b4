package kmsplugin

//lint:file-ignore SA1019 KMS v1 (k8s.io/kms/apis/v1beta1) is deprecated upstream; this file speaks it on purpose, so clusters still holding v1 values can be read and moved off it.

import (
	"context"
	"encoding/base64"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	kmsv1api "k8s.io/kms/apis/v1beta1"
	"k8s.io/kms/pkg/service"
)

func writeKeys(t *testing.T, path string, names ...string) {
	t.Helper()
	var b strings.Builder
	b.WriteString("keys:\n")
	for _, n := range names {
		fmt.Fprintf(&b, "- name: %s\n  secret: %s\n", n, base64.StdEncoding.EncodeToString([]byte(strings.Repeat(n[:1], 32))))
	}
	if err := os.WriteFile(path+".tmp", []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
}

func TestRotationAndControlAPI(t *testing.T) {
	dir, _ := os.MkdirTemp("", "kms")
	defer os.RemoveAll(dir)
	keys := filepath.Join(dir, "keys.yaml")
	writeKeys(t, keys, "a1")
	s, err := Start(Options{ListenAddr: "unix://" + filepath.Join(dir, "p.sock"), KeysFile: keys, ControlAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	ctx := context.Background()
	st, err := s.Status(ctx)
	if err != nil || st.KeyID != "a1" || st.Healthz != "ok" || st.Version != "v2" {
		t.Fatalf("Status %+v %v", st, err)
	}
	enc, err := s.Encrypt(ctx, "u", []byte("seed"))
	if err != nil || enc.KeyID != "a1" {
		t.Fatal(err)
	}
	writeKeys(t, keys, "b2", "a1")
	if st, _ := s.Status(ctx); st.KeyID != "b2" {
		t.Fatalf("after editing the file the key id is %q, want b2", st.KeyID)
	}
	pt, err := s.Decrypt(ctx, "u", &service.DecryptRequest{Ciphertext: enc.Ciphertext, KeyID: "a1"})
	if err != nil || string(pt) != "seed" {
		t.Fatalf("old key cannot decrypt after rotation: %v", err)
	}
	if _, err := s.Decrypt(ctx, "u", &service.DecryptRequest{Ciphertext: enc.Ciphertext, KeyID: "b2"}); err == nil {
		t.Fatal("decrypt under the wrong key id succeeded")
	}
	os.WriteFile(keys, []byte("not: [valid"), 0o600)
	if st, err := s.Status(ctx); err != nil || st.KeyID != "b2" {
		t.Fatalf("an invalid file must keep the last keyring: %+v %v", st, err)
	}

	base := "http://" + s.ControlAddr() + "/faults"
	req, _ := http.NewRequest(http.MethodPut, base, strings.NewReader(`{"statusHealthz":"sick","failEncrypt":true,"failCode":"PermissionDenied","latency":"1ms"}`))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("PUT faults: %v %v", resp, err)
	}
	resp.Body.Close()
	if st, _ := s.Status(ctx); st.Healthz != "sick" {
		t.Fatalf("healthz %q", st.Healthz)
	}
	if _, err := s.Encrypt(ctx, "u", []byte("x")); err == nil || !strings.Contains(err.Error(), "PermissionDenied") {
		t.Fatalf("Encrypt with an injected failure: %v", err)
	}
	req, _ = http.NewRequest(http.MethodPut, base, strings.NewReader(`{"bogus":1}`))
	req.Header.Set("Content-Type", "application/json")
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 400 {
		t.Fatalf("unknown field accepted: %v", resp.StatusCode)
	}
	req, _ = http.NewRequest(http.MethodDelete, base, nil)
	req.Header.Set("Content-Type", "application/json")
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 200 {
		t.Fatal(err)
	}
	if st, _ := s.Status(ctx); st.Healthz != "ok" {
		t.Fatal("DELETE /faults did not restore health")
	}
	if s.Stats().Status < 5 {
		t.Fatalf("stats %+v", s.Stats())
	}
}

func TestBadOptions(t *testing.T) {
	if _, err := Start(Options{ListenAddr: "tcp://x", KeysFile: "x"}); err == nil {
		t.Fatal("non-unix listen address accepted")
	}
	dir, _ := os.MkdirTemp("", "kms")
	defer os.RemoveAll(dir)
	keys := filepath.Join(dir, "k.yaml")
	os.WriteFile(keys, []byte("keys:\n- name: a\n  secret: c2hvcnQ=\n"), 0o600)
	if _, err := Start(Options{ListenAddr: "unix://" + dir + "/s", KeysFile: keys}); err == nil || !strings.Contains(err.Error(), "32 bytes") {
		t.Fatalf("short secret: %v", err)
	}
	writeKeys(t, keys, "a")
	if _, err := Start(Options{ListenAddr: "unix://" + dir + "/s", KeysFile: keys, ControlAddr: "10.1.2.3:80"}); err == nil {
		t.Fatal("non-loopback control address accepted")
	}
}

// The KMS v1 mode speaks v1beta1: Version, and Decrypt of what Encrypt wrapped; an API
// version it does not serve is refused at start.
func TestKMSv1Mode(t *testing.T) {
	dir := t.TempDir()
	keys := filepath.Join(dir, "keys.yaml")
	if err := os.WriteFile(keys, []byte("keys:\n- {name: k1, secret: "+base64.StdEncoding.EncodeToString(make([]byte, 32))+"}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Start(Options{ListenAddr: "unix://" + filepath.Join(dir, "x.sock"), KeysFile: keys, APIVersion: "v3"}); err == nil {
		t.Fatal("API version v3 served")
	}
	s, err := Start(Options{ListenAddr: "unix://" + filepath.Join(dir, "v1.sock"), KeysFile: keys, APIVersion: APIVersionV1})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "v1.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	api := kmsv1api.NewKeyManagementServiceClient(conn)
	ctx := context.Background()
	v, err := api.Version(ctx, &kmsv1api.VersionRequest{Version: "v1beta1"})
	if err != nil || v.Version != "v1beta1" {
		t.Fatalf("Version: %v %v", v, err)
	}
	enc, err := api.Encrypt(ctx, &kmsv1api.EncryptRequest{Version: "v1beta1", Plain: []byte("dek")})
	if err != nil {
		t.Fatal(err)
	}
	dec, err := api.Decrypt(ctx, &kmsv1api.DecryptRequest{Version: "v1beta1", Cipher: enc.Cipher})
	if err != nil || string(dec.Plain) != "dek" {
		t.Fatalf("Decrypt: %v %v", dec, err)
	}
	enc.Cipher[len(enc.Cipher)-1] ^= 1
	if _, err := api.Decrypt(ctx, &kmsv1api.DecryptRequest{Version: "v1beta1", Cipher: enc.Cipher}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("Decrypt of a corrupted ciphertext: %v", err)
	}
}
