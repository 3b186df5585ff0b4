package reload

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/rekey-io/rekey/internal/configtest"
)

// TestSecretEchoNeverReachesStatus: a refused reload records its error in the status
// document, and a refused start returns it; neither may quote a secret of the file
// (the secret-echo table of internal/configtest).
func TestSecretEchoNeverReachesStatus(t *testing.T) {
	f := newFixture(t, secretsConfig("aesgcm:k1"))
	for _, tc := range configtest.SecretEcho() {
		t.Run(tc.Name, func(t *testing.T) {
			writeRename(t, f.path, tc.Data)
			if err := f.agent.Reload(context.Background()); err == nil {
				t.Fatal("Reload accepted a malformed config")
			}
			st := f.agent.Status()
			if st.LastError == "" {
				t.Fatal("the refusal is not recorded")
			}
			if leaks := configtest.Leaks(st.LastError, tc.Secrets...); len(leaks) > 0 {
				t.Fatalf("status lastError quotes a secret (%q): %s", leaks, st.LastError)
			}

			path := filepath.Join(t.TempDir(), "start.yaml")
			if err := os.WriteFile(path, []byte(tc.Data), 0o600); err != nil {
				t.Fatal(err)
			}
			a, err := NewAgent(context.Background(), Options{Path: path})
			if err == nil {
				a.Close()
				t.Fatal("NewAgent accepted a malformed config")
			}
			if leaks := configtest.Leaks(err.Error(), tc.Secrets...); len(leaks) > 0 {
				t.Fatalf("startup error quotes a secret (%q): %v", leaks, err)
			}
		})
	}
}
