package migrate

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/enctest"

	"github.com/rekey-io/rekey/pkg/transformers"
)

func TestIsTransient(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"plain", errors.New("aesgcm: message authentication failed"), false},
		{"no matching prefix", errors.New("no matching prefix found"), false},
		{"gRPC Unavailable, wrapped", fmt.Errorf("failed to decrypt DEK, error: %w", status.Error(codes.Unavailable, "down")), true},
		{"gRPC DeadlineExceeded", status.Error(codes.DeadlineExceeded, "slow"), true},
		{"gRPC ResourceExhausted", status.Error(codes.ResourceExhausted, "busy"), true},
		{"gRPC InvalidArgument", status.Error(codes.InvalidArgument, "bad ciphertext"), false},
		{"gRPC Internal", status.Error(codes.Internal, "plugin cannot decrypt"), false},
		{"context deadline", fmt.Errorf("reading: %w", context.DeadlineExceeded), true},
		{"provider not ready", transformers.Unavailable(errors.New("cannot write yet")), true},
		{"aggregate with a provider not ready", utilerrors.NewAggregate([]error{errors.New("x"), transformers.Unavailable(errors.New("expired"))}), true},
	} {
		if got := isTransient(tc.err); got != tc.want {
			t.Errorf("%s: isTransient = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// A KMS v1 plugin that is down fails reads of its values transiently, as a KMS v2
// plugin does: the value is not unreadable, migration retries.
func TestKMSv1PluginDownIsTransient(t *testing.T) {
	plugin := enctest.StartKMSv1(t, "kek1")
	yaml := enctest.ConfigYAML("secrets", "aesgcm:k1") + strings.ReplaceAll(plugin.ProviderYAML("old"), "timeout: 3s", "timeout: 200ms")
	set := enctest.MustSet(t, enctest.MustConfig(t, yaml))
	aad := value.DefaultContext("/registry/secrets/ns/a")
	v, err := enctest.UpstreamKMSv1(t, plugin.Endpoint(), "old", false).TransformToStorage(context.Background(), []byte("x"), aad)
	if err != nil {
		t.Fatal(err)
	}
	plugin.Server.Stop()
	_, _, err = set.TransformerFor(schema.GroupResource{Resource: "secrets"}).TransformFromStorage(context.Background(), v, aad)
	if err == nil || !isTransient(err) {
		t.Fatalf("read with the KMS v1 plugin down: %v; want a transient error", err)
	}
	if !strings.Contains(err.Error(), `kms v1 provider "old"`) {
		t.Fatalf("error %q does not name the provider", err)
	}
}
