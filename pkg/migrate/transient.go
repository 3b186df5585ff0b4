package migrate

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// errPluginUnavailable reports that a migration or decrypt-checked inventory stopped
// because a KMS plugin could not serve (down, timing out, overloaded, not ready). It
// says nothing about the stored data: nothing was counted unreadable, and the
// controller retries with backoff.
var errPluginUnavailable = errors.New("KMS plugin unavailable, will retry")

// isTransient tells a failure of the KMS plugin or of the call itself from a value that
// cannot be decrypted: gRPC Unavailable, DeadlineExceeded, ResourceExhausted or
// Canceled, an expired or cancelled context, or a KMS provider that is not ready to
// write (transformers.ErrKMSUnavailable).
func isTransient(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, errPluginUnavailable) || errors.Is(err, transformers.ErrKMSUnavailable) ||
		errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return true
	}
	if s, ok := status.FromError(err); ok {
		switch s.Code() {
		case codes.Unavailable, codes.DeadlineExceeded, codes.ResourceExhausted, codes.Canceled:
			return true
		}
	}
	return false
}

// transient wraps a plugin failure met while handling key.
func transient(key []byte, err error) error {
	return fmt.Errorf("%w: nothing was counted unreadable; handling %s: %w", errPluginUnavailable, key, err)
}
