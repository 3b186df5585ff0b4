package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/rekey-io/rekey/internal/configtest"
)

// TestCheckConfigNeverEchoesSecrets runs `rekey check-config` on the secret-echo table:
// the refusal (returned error and everything the command printed) must not quote a
// secret. The new config is loaded before etcd is contacted, so no server is needed.
func TestCheckConfigNeverEchoesSecrets(t *testing.T) {
	dir := t.TempDir()
	good := writeConfig(t, "current.yaml", "key1")
	for i, tc := range configtest.SecretEcho() {
		t.Run(tc.Name, func(t *testing.T) {
			path := filepath.Join(dir, fmt.Sprintf("new%d.yaml", i))
			if err := os.WriteFile(path, []byte(tc.Data), 0o600); err != nil {
				t.Fatal(err)
			}
			cmd := newRootCommand()
			var out bytes.Buffer
			cmd.SetOut(&out)
			cmd.SetErr(&out)
			cmd.SetArgs([]string{"check-config", "--etcd-servers", "http://127.0.0.1:1", "--encryption-provider-config", good, "--new", path})
			err := cmd.ExecuteContext(context.Background())
			if err == nil {
				t.Fatalf("check-config accepted a malformed config; output:\n%s", out.String())
			}
			text := err.Error() + "\n" + out.String()
			if leaks := configtest.Leaks(text, tc.Secrets...); len(leaks) > 0 {
				t.Fatalf("check-config quotes a secret (%q):\n%s", leaks, text)
			}
		})
	}
}
