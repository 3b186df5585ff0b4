package kmsplugin

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func startWithControl(t *testing.T) *Server {
	t.Helper()
	dir := t.TempDir()
	keys := filepath.Join(dir, "keys.yaml")
	writeKeys(t, keys, "a1")
	s, err := Start(Options{ListenAddr: "unix://" + filepath.Join(dir, "p.sock"), KeysFile: keys, ControlAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s
}

// TestControlRefusesBrowserShapedRequests: a cross-site form post (no JSON content
// type) and a DNS-rebound request (foreign Host) must not change the faults.
func TestControlRefusesBrowserShapedRequests(t *testing.T) {
	s := startWithControl(t)
	url := "http://" + s.ControlAddr() + "/faults"
	body := `{"failEncrypt":true}`
	cases := []struct {
		name, method, host, contentType string
		want                            int
	}{
		{"form post", http.MethodPost, "", "application/x-www-form-urlencoded", http.StatusUnsupportedMediaType},
		{"text/plain post", http.MethodPost, "", "text/plain", http.StatusUnsupportedMediaType},
		{"put without type", http.MethodPut, "", "", http.StatusUnsupportedMediaType},
		{"delete without type", http.MethodDelete, "", "", http.StatusUnsupportedMediaType},
		{"rebound host", http.MethodPut, "evil.example:80", "application/json", http.StatusForbidden},
		{"rebound host on get", http.MethodGet, "evil.example", "", http.StatusForbidden},
		{"host that only starts with 127", http.MethodPut, "127.0.0.1.evil.example", "application/json", http.StatusForbidden},
	}
	for _, tc := range cases {
		req, _ := http.NewRequest(tc.method, url, strings.NewReader(body))
		if tc.host != "" {
			req.Host = tc.host
		}
		if tc.contentType != "" {
			req.Header.Set("Content-Type", tc.contentType)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("%s: status %d, want %d", tc.name, resp.StatusCode, tc.want)
		}
		if s.Faults().FailEncrypt {
			t.Fatalf("%s: the request changed the faults", tc.name)
		}
	}
	// Local clients that say JSON still work, under every loopback name.
	for _, host := range []string{"", "localhost", "LOCALHOST:1234", "127.0.0.1", "127.1.2.3:80", "[::1]:9", "[::1]"} {
		req, _ := http.NewRequest(http.MethodPut, url, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json; charset=utf-8")
		if host != "" {
			req.Host = host
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("Host %q: %v %v", host, resp, err)
		}
		resp.Body.Close()
		if !s.Faults().FailEncrypt {
			t.Fatalf("Host %q: faults not applied", host)
		}
		s.SetFaults(Faults{})
	}
}

// TestSocketDirectoryMustBePrivate: the gRPC socket is refused in a directory another
// user could write to or that is a symlink, and the default lands in a private one.
func TestSocketDirectoryMustBePrivate(t *testing.T) {
	base := t.TempDir()
	keys := filepath.Join(base, "keys.yaml")
	writeKeys(t, keys, "a1")

	shared := filepath.Join(base, "shared")
	if err := os.Mkdir(shared, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(shared, 0o1777); err != nil { // like /tmp
		t.Fatal(err)
	}
	groupW := filepath.Join(base, "group")
	if err := os.Mkdir(groupW, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(groupW, 0o770); err != nil {
		t.Fatal(err)
	}
	private := filepath.Join(base, "private")
	if err := os.Mkdir(private, 0o700); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(base, "link")
	if err := os.Symlink(private, link); err != nil {
		t.Fatal(err)
	}
	unsafe := map[string]string{shared: "writable by other users", groupW: "writable by other users", link: "is a symlink"}
	// Another user's directory (only root can make one here).
	foreign := filepath.Join(base, "foreign")
	if err := os.Mkdir(foreign, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(foreign, 65534, 65534); err == nil {
		unsafe[foreign] = "belongs to uid 65534"
	}
	for dir, want := range unsafe {
		s, err := Start(Options{ListenAddr: "unix://" + filepath.Join(dir, "p.sock"), KeysFile: keys})
		if err == nil {
			s.Stop()
			t.Errorf("%s: listened in an unsafe directory", dir)
			continue
		}
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%s: error %q does not say %q", dir, err, want)
		}
	}
	s, err := Start(Options{ListenAddr: "unix://" + filepath.Join(private, "p.sock"), KeysFile: keys})
	if err != nil {
		t.Fatalf("private directory refused: %v", err)
	}
	s.Stop()

	// The default: a private directory under $XDG_RUNTIME_DIR, created 0700.
	runtime := filepath.Join(base, "run")
	if err := os.Mkdir(runtime, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Setenv("XDG_RUNTIME_DIR", runtime)
	if got, want := DefaultListenAddr(), "unix://"+filepath.Join(runtime, "rekey-kms", "plugin.sock"); got != want {
		t.Fatalf("DefaultListenAddr = %s, want %s", got, want)
	}
	s, err = Start(Options{KeysFile: keys})
	if err != nil {
		t.Fatalf("default listen address: %v", err)
	}
	defer s.Stop()
	fi, err := os.Lstat(filepath.Join(runtime, "rekey-kms"))
	if err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o700 {
		t.Fatalf("default socket directory: %v %v", fi.Mode(), err)
	}
	if _, err := os.Stat(filepath.Join(runtime, "rekey-kms", "plugin.sock")); err != nil {
		t.Fatalf("no socket in the default directory: %v", err)
	}
	// Without XDG_RUNTIME_DIR the fallback names the user, not a shared fixed path.
	t.Setenv("XDG_RUNTIME_DIR", "")
	if got := DefaultListenAddr(); !strings.Contains(got, "rekey-kms-") || strings.HasSuffix(got, "/tmp/kms-plugin.sock") {
		t.Fatalf("fallback default %s is not per-user", got)
	}
}
