package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	kmsapi "k8s.io/kms/apis/v2"

	"github.com/rekey-io/rekey/internal/freeport"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
	"github.com/rekey-io/rekey/plugins/kms-pkcs11/internal/softhsmtest"
)

// binary is this command, built once by TestMain for every test of the package.
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "rekey-kms-pkcs11-bin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "rekey-kms-pkcs11")
	if out, err := exec.Command("go", "build", "-o", binary, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "go build: %v\n%s", err, out)
		_ = os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

type env struct {
	bin, pinFile, sock string
	h                  *softhsmtest.Token
}

func (e *env) tokenArgs() []string {
	return []string{"--module", e.h.Module, "--token-label", e.h.Label, "--pin-file", e.pinFile, "--key-label", "kek", "--max-sessions", fmt.Sprint(softhsmtest.MaxSessions)}
}

func (e *env) run(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command(e.bin, append(args, e.tokenArgs()...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

func (e *env) serve(t *testing.T, extra ...string) *exec.Cmd {
	cmd, _ := e.serveLogged(t, extra...)
	return cmd
}

// syncBuffer is a bytes.Buffer a process writes and the test reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func (e *env) serveLogged(t *testing.T, extra ...string) (*exec.Cmd, *syncBuffer) {
	t.Helper()
	args := append([]string{"serve", "--listen-addr", "unix://" + e.sock, "--state-refresh-interval", "200ms"}, e.tokenArgs()...)
	cmd := exec.Command(e.bin, append(args, extra...)...)
	logs := &syncBuffer{}
	cmd.Stderr = logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("plugin log:\n%s", logs.String())
		}
	})
	return cmd, logs
}

func (e *env) client(t *testing.T) kmsapi.KeyManagementServiceClient {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+e.sock, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", e.sock)
	}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return kmsapi.NewKeyManagementServiceClient(conn)
}

func waitHealthy(t *testing.T, c kmsapi.KeyManagementServiceClient, keyID string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		st, err := c.Status(ctx, &kmsapi.StatusRequest{})
		cancel()
		if err == nil && st.Healthz == "ok" && (keyID == "" || st.KeyId == keyID) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the plugin did not become healthy with key id %q: %+v, %v", keyID, st, err)
		}
		time.Sleep(50 * time.Millisecond) // polling another process
	}
}

func newEnv(t *testing.T) *env {
	h := softhsmtest.New(t)
	dir, err := os.MkdirTemp("", "kp")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	e := &env{bin: binary, pinFile: filepath.Join(dir, "pin"), sock: filepath.Join(dir, "kms.sock"), h: h}
	if err := os.WriteFile(e.pinFile, []byte(h.PIN+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return e
}

type sealed struct {
	keyID, pt string
	ct        []byte
}

// TestSIGKILLDuringRotation: twice, the plugin process is killed with SIGKILL while
// writers seal and a rotation runs in another process; once restarted, every
// ciphertext of every version decrypts, the last rotation's version is current and no
// version number was issued twice.
func TestSIGKILLDuringRotation(t *testing.T) {
	e := newEnv(t)
	e.run(t, "rotate")
	srv := e.serve(t)
	c := e.client(t)
	waitHealthy(t, c, "kek:v1")

	var mu sync.Mutex
	var all []sealed
	writers := func() (stop func()) {
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		for w := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; ctx.Err() == nil; i++ {
					pt := fmt.Sprintf("w%d-%d", w, i)
					cctx, ccancel := context.WithTimeout(ctx, time.Second)
					r, err := c.Encrypt(cctx, &kmsapi.EncryptRequest{Plaintext: []byte(pt), Uid: pt})
					ccancel()
					if err == nil {
						mu.Lock()
						all = append(all, sealed{r.KeyId, pt, r.Ciphertext})
						mu.Unlock()
					}
				}
			}()
		}
		return func() { cancel(); wg.Wait() }
	}
	for round := 2; round <= 3; round++ {
		stop := writers()
		time.Sleep(300 * time.Millisecond) // the writers seal under the current version
		rot := exec.Command(e.bin, append([]string{"rotate"}, e.tokenArgs()...)...)
		if err := rot.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond) // the rotation is under way
		if err := srv.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		_ = srv.Wait()
		if err := rot.Wait(); err != nil {
			t.Fatalf("rotate: %v", err)
		}
		stop()
		srv = e.serve(t)
		waitHealthy(t, c, fmt.Sprintf("kek:v%d", round))
	}
	stop := writers()
	time.Sleep(200 * time.Millisecond)
	stop()
	byKey := map[string]int{}
	for _, s := range all {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		r, err := c.Decrypt(ctx, &kmsapi.DecryptRequest{Ciphertext: s.ct, KeyId: s.keyID, Uid: s.pt})
		cancel()
		if err != nil || string(r.Plaintext) != s.pt {
			t.Fatalf("%s sealed under %s does not decrypt after the restarts: %v", s.pt, s.keyID, err)
		}
		byKey[s.keyID]++
	}
	if byKey["kek:v1"] == 0 || byKey["kek:v3"] == 0 {
		t.Fatalf("sealed per key id: %v; want values under v1 and v3 at least", byKey)
	}
	t.Logf("%d ciphertexts decrypted after two SIGKILLs: %v", len(all), byKey)
	list := e.run(t, "list")
	for _, want := range []string{state.KeyIDHash("kek:v1"), state.KeyIDHash("kek:v2"), state.KeyIDHash("kek:v3"), "current", "highest version issued: 3"} {
		if !strings.Contains(list, want) {
			t.Fatalf("list does not show %q:\n%s", want, list)
		}
	}
	if strings.Contains(list, "kek:v") {
		t.Fatalf("list prints a key id itself, not only its hash:\n%s", list)
	}
	var doc struct {
		Versions []struct {
			Version   uint64 `json:"version"`
			KeyIDHash string `json:"keyIDHash"`
			State     string `json:"state"`
		} `json:"versions"`
		Highest uint64 `json:"highestIssued"`
	}
	if err := json.Unmarshal([]byte(e.run(t, "list", "-o", "json")), &doc); err != nil || len(doc.Versions) != 3 || doc.Highest != 3 || doc.Versions[2].State != "current" || !strings.HasPrefix(doc.Versions[0].KeyIDHash, "sha256:") {
		t.Fatalf("list -o json: %+v, %v", doc, err)
	}
	// retire refuses without a way to check the cluster.
	out, err := exec.Command(e.bin, append([]string{"retire", "1"}, e.tokenArgs()...)...).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "--etcd-servers is required") {
		t.Fatalf("retire without --etcd-servers: %v\n%s", err, out)
	}
	// Nor when etcd does not answer: nothing is let go blind.
	port, perr := freeport.Pick()
	if perr != nil {
		t.Fatal(perr)
	}
	out, err = exec.Command(e.bin, append([]string{"retire", "1", "--etcd-servers", fmt.Sprintf("http://127.0.0.1:%d", port), "--etcd-dial-timeout", "1s"}, e.tokenArgs()...)...).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "etcd does not answer") {
		t.Fatalf("retire with etcd down: %v\n%s", err, out)
	}
	if list := e.run(t, "list"); strings.Contains(list, "retired") {
		t.Fatalf("a version was retired although the check could not run:\n%s", list)
	}
}

// TestSIGTERMAndMetrics: the metrics endpoint serves the plugin's own metrics (never
// the PIN or a key id in clear); SIGTERM ends the process cleanly (exit 0) after it
// logged the shutdown.
func TestSIGTERMAndMetrics(t *testing.T) {
	e := newEnv(t)
	e.run(t, "rotate")
	port, err := freeport.Pick()
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	srv, logs := e.serveLogged(t, "--metrics-addr", addr)
	c := e.client(t)
	waitHealthy(t, c, "kek:v1")
	r, err := c.Encrypt(context.Background(), &kmsapi.EncryptRequest{Plaintext: []byte("seed"), Uid: "u"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Decrypt(context.Background(), &kmsapi.DecryptRequest{Ciphertext: r.Ciphertext, KeyId: r.KeyId, Uid: "u"}); err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	for _, want := range []string{
		`rekey_kms_pkcs11_requests_total{method="Encrypt",result="ok"} 1`,
		`rekey_kms_pkcs11_requests_total{method="Decrypt",result="ok"} 1`,
		`rekey_kms_pkcs11_login_attempts_total{result="ok"} 1`,
		"rekey_kms_pkcs11_healthy 1",
		"rekey_kms_pkcs11_current_version 1",
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	if strings.Contains(string(body), e.h.PIN) || strings.Contains(string(body), "go_gc_duration_seconds") {
		t.Errorf("metrics show the PIN, or the global registry's metrics:\n%s", body)
	}
	if err := srv.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v\n%s", err, logs)
		}
	case <-time.After(15 * time.Second):
		t.Fatalf("still running 15 s after SIGTERM\n%s", logs)
	}
	out := logs.String()
	if !strings.Contains(out, "shutting down") || strings.Contains(out, e.h.PIN) {
		t.Fatalf("log after SIGTERM:\n%s", out)
	}
}
