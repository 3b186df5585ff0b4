package reload

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// Every write asks Options.WriteGate first and is refused with its error; reads never
// ask it.
func TestWriteGateIsAskedBeforeEveryWrite(t *testing.T) {
	path := filepath.Join(t.TempDir(), "c.yaml")
	if err := os.WriteFile(path, []byte(configYAML(rule([]string{"secrets"}, "aesgcm:k1"))), 0o600); err != nil {
		t.Fatal(err)
	}
	var closed atomic.Bool
	held := &transformers.WriteRefusedError{Reason: "held"}
	a, err := NewAgent(context.Background(), Options{Path: path, WriteGate: func() error {
		if closed.Load() {
			return held
		}
		return nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	tr := a.TransformerForResource(schema.GroupResource{Resource: "secrets"})
	ctx, dataCtx := context.Background(), value.DefaultContext("/registry/secrets/ns/s")
	stored, err := tr.TransformToStorage(ctx, []byte("v"), dataCtx)
	if err != nil {
		t.Fatalf("write with the gate open: %v", err)
	}
	closed.Store(true)
	if _, err := tr.TransformToStorage(ctx, []byte("w"), dataCtx); !errors.Is(err, held) {
		t.Fatalf("write with the gate closed: %v; want the gate's refusal", err)
	}
	if plain, _, err := tr.TransformFromStorage(ctx, stored, dataCtx); err != nil || string(plain) != "v" {
		t.Fatalf("read with the gate closed = %q, %v; want v", plain, err)
	}
}
