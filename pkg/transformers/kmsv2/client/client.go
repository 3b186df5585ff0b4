// Package client is a KMS v2 gRPC client (k8s.io/kms/apis/v2) over a unix socket,
// including Linux abstract sockets (unix:///@name; pkg/transformers/kmsdial dials it).
// Construction never blocks: the connection is made on the first call and remade
// after the plugin restarts. Every call is bounded by the configured timeout, and its
// latency is recorded under kube-apiserver's metric name and labels.
package client

import (
	"context"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	kmsapi "k8s.io/kms/apis/v2"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers/kmsdial"
)

// Full gRPC method names, the method_name label values.
const (
	MethodStatus  = "/v2.KeyManagementService/Status"
	MethodEncrypt = "/v2.KeyManagementService/Encrypt"
	MethodDecrypt = "/v2.KeyManagementService/Decrypt"
)

// LatencyRecorder receives the duration and outcome of every RPC.
type LatencyRecorder interface {
	ObserveRPC(method string, code codes.Code, d time.Duration)
}

// Client talks to one plugin.
type Client struct {
	conn    *grpc.ClientConn
	api     kmsapi.KeyManagementServiceClient
	timeout time.Duration
	addr    string
}

// New creates a client for endpoint. It does not connect; the first call does.
// timeout bounds each call (the config's `timeout`); rec may be nil.
func New(endpoint string, timeout time.Duration, rec LatencyRecorder) (*Client, error) {
	if timeout <= 0 {
		timeout = config.DefaultKMSTimeout
	}
	var observe func(string, codes.Code, time.Duration)
	if rec != nil {
		observe = rec.ObserveRPC
	}
	conn, addr, err := kmsdial.Dial(endpoint, timeout, observe)
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn, api: kmsapi.NewKeyManagementServiceClient(conn), timeout: timeout, addr: addr}, nil
}

// Close closes the connection; calls in flight fail with codes.Canceled.
func (c *Client) Close() error { return c.conn.Close() }

// FailFast is the call option of a call that must not wait for a connection: it fails
// at once with codes.Unavailable when the plugin cannot be reached (no socket, nobody
// listening), where a call without it waits for the plugin until its deadline. A
// connection that is being made is still waited for (a few milliseconds on a unix
// socket).
func FailFast() grpc.CallOption { return grpc.WaitForReady(false) }

// State is the connection's state: connectivity.TransientFailure while the last
// attempt to reach the plugin failed and the next one has not succeeded yet.
func (c *Client) State() connectivity.State { return c.conn.GetState() }

// StatusResponse is the plugin's Status answer.
type StatusResponse struct{ Version, Healthz, KeyID string }

// Status calls Status. opts are gRPC call options (FailFast).
func (c *Client) Status(ctx context.Context, opts ...grpc.CallOption) (StatusResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	r, err := c.api.Status(ctx, &kmsapi.StatusRequest{}, opts...)
	if err != nil {
		return StatusResponse{}, err
	}
	return StatusResponse{Version: r.Version, Healthz: r.Healthz, KeyID: r.KeyId}, nil
}

// EncryptResponse is the plugin's Encrypt answer.
type EncryptResponse struct {
	Ciphertext  []byte
	KeyID       string
	Annotations map[string][]byte
}

// Encrypt calls Encrypt. opts are gRPC call options (FailFast).
func (c *Client) Encrypt(ctx context.Context, uid string, plaintext []byte, opts ...grpc.CallOption) (EncryptResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	r, err := c.api.Encrypt(ctx, &kmsapi.EncryptRequest{Plaintext: plaintext, Uid: uid}, opts...)
	if err != nil {
		return EncryptResponse{}, err
	}
	return EncryptResponse{Ciphertext: r.Ciphertext, KeyID: r.KeyId, Annotations: r.Annotations}, nil
}

// Decrypt calls Decrypt. opts are gRPC call options (FailFast).
func (c *Client) Decrypt(ctx context.Context, uid, keyID string, ciphertext []byte, annotations map[string][]byte, opts ...grpc.CallOption) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	r, err := c.api.Decrypt(ctx, &kmsapi.DecryptRequest{Ciphertext: ciphertext, Uid: uid, KeyId: keyID, Annotations: annotations}, opts...)
	if err != nil {
		return nil, err
	}
	return r.Plaintext, nil
}
