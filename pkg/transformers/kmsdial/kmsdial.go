// Package kmsdial reaches a KMS plugin over a unix socket, whichever API version it
// speaks (pkg/transformers/kmsv2/client for v2, pkg/transformers/kmsv1 for v1): the
// endpoint's parsing, including Linux abstract sockets (unix:///@name), and the gRPC
// connection, which never blocks at construction and is remade quickly after the plugin
// restarts.
package kmsdial

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// ParseEndpoint returns the socket address of a `unix://` endpoint; an abstract socket
// keeps its leading '@' (Go's net package maps it to the abstract namespace).
func ParseEndpoint(endpoint string) (string, error) {
	if endpoint == "" {
		return "", errors.New("kms endpoint is empty; set it to unix:///path/to/plugin.sock")
	}
	u, err := url.Parse(endpoint)
	if err != nil {
		return "", fmt.Errorf("kms endpoint %q is not a URL (%v); use unix:///path/to/plugin.sock", endpoint, err)
	}
	if u.Scheme != "unix" {
		return "", fmt.Errorf("kms endpoint %q has scheme %q; only unix:// sockets are supported", endpoint, u.Scheme)
	}
	if strings.HasPrefix(u.Path, "/@") {
		return strings.TrimPrefix(u.Path, "/"), nil
	}
	if u.Path == "" {
		return "", fmt.Errorf("kms endpoint %q has no socket path", endpoint)
	}
	return u.Path, nil
}

// Dial is the gRPC connection of a KMS plugin at endpoint, of either API version: it
// does not connect (the first call does), waits for the plugin up to each call's
// deadline, and reconnects within a second of a plugin restart. timeout is the call
// timeout; observe, when set, is told every call's method, outcome and duration. addr
// is the socket address.
func Dial(endpoint string, timeout time.Duration, observe func(method string, code codes.Code, d time.Duration)) (conn *grpc.ClientConn, addr string, err error) {
	addr, err = ParseEndpoint(endpoint)
	if err != nil {
		return nil, "", err
	}
	opts := []grpc.DialOption{
		grpc.WithAuthority("localhost"),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		// Wait for a connection up to the call deadline: a plugin that restarts is
		// reached as soon as it listens again. A caller that knows the plugin is gone
		// passes grpc.WaitForReady(false) instead (the v2 client's FailFast).
		grpc.WithDefaultCallOptions(grpc.WaitForReady(true)),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", addr)
		}),
		// Reconnect quickly after a plugin restart (gRPC's default backs off to 120 s).
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: timeout,
		}),
	}
	if observe != nil {
		opts = append(opts, grpc.WithUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, o ...grpc.CallOption) error {
			start := time.Now()
			err := invoker(ctx, method, req, reply, cc, o...)
			observe(method, status.Code(err), time.Since(start))
			return err
		}))
	}
	conn, err = grpc.NewClient("passthrough:///localhost", opts...)
	if err != nil {
		return nil, "", fmt.Errorf("kms: cannot create a gRPC client for %s: %w", endpoint, err)
	}
	return conn, addr, nil
}
