package kmsv1

//lint:file-ignore SA1019 KMS v1 (k8s.io/kms/apis/v1beta1) is deprecated upstream; this file speaks it on purpose, so clusters still holding v1 values can be read and moved off it.

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	kmsapi "k8s.io/kms/apis/v1beta1"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers/kmsdial"
)

// APIVersion is the version a KMS v1 plugin must report, and the one its requests carry.
const APIVersion = "v1beta1"

// Client calls Decrypt of one KMS v1 plugin. Construction never blocks: the first call
// connects, and a plugin that restarts is reached again as soon as it listens.
type Client struct {
	conn    *grpc.ClientConn
	api     kmsapi.KeyManagementServiceClient
	timeout time.Duration
	// versionChecked is set once the plugin said it speaks v1beta1, as upstream checks
	// before its first call.
	versionChecked atomic.Bool
}

// Dial creates a client for endpoint (unix:///path.sock); timeout bounds each call.
func Dial(endpoint string, timeout time.Duration) (*Client, error) {
	if timeout <= 0 {
		timeout = config.DefaultKMSTimeout
	}
	conn, _, err := kmsdial.Dial(endpoint, timeout, nil)
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn, api: kmsapi.NewKeyManagementServiceClient(conn), timeout: timeout}, nil
}

// Decrypt unwraps an encrypted DEK. Errors of the call keep their gRPC status.
func (c *Client) Decrypt(ctx context.Context, encryptedDEK []byte) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	if !c.versionChecked.Load() {
		r, err := c.api.Version(ctx, &kmsapi.VersionRequest{Version: APIVersion})
		if err != nil {
			return nil, fmt.Errorf("asking the plugin for its API version: %w", err)
		}
		if r.Version != APIVersion {
			return nil, status.Errorf(codes.FailedPrecondition, "the plugin speaks KMS API %q, not %q: the endpoint of a KMS v1 provider must be a KMS v1 plugin", r.Version, APIVersion)
		}
		c.versionChecked.Store(true)
	}
	r, err := c.api.Decrypt(ctx, &kmsapi.DecryptRequest{Version: APIVersion, Cipher: encryptedDEK})
	if err != nil {
		return nil, err
	}
	return r.Plain, nil
}

// Close closes the connection; calls in flight fail with codes.Canceled.
func (c *Client) Close() error { return c.conn.Close() }
