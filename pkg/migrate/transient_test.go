package migrate

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	utilerrors "k8s.io/apimachinery/pkg/util/errors"

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
