package kmsv2

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsdial"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/client"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
)

// PreflightStage is the step of a preflight that failed.
type PreflightStage string

// The steps of Preflight, in order.
const (
	PreflightDial     PreflightStage = "dial failed"
	PreflightStatus   PreflightStage = "status not ok"
	PreflightVersion  PreflightStage = "wrong API version"
	PreflightNoKeyID  PreflightStage = "no key id"
	PreflightEncrypt  PreflightStage = "encrypt failed"
	PreflightDecrypt  PreflightStage = "decrypt failed"
	PreflightMismatch PreflightStage = "round trip mismatch"
	PreflightTimeout  PreflightStage = "timed out"
)

// preflightPlaintextSize is the size of the random test plaintext: a DEK seed's, so the
// plugin sees exactly what it will be asked to wrap.
const preflightPlaintextSize = seedSize

// PreflightError says which plugin failed which step of Preflight. It carries no key
// material: the plugin's own error text and, for Status, its healthz string.
type PreflightError struct {
	Provider string
	Endpoint string
	Stage    PreflightStage
	// Detail is what the plugin answered (healthz, version, its error), or the timeout.
	Detail string
	Err    error
}

func (e *PreflightError) Error() string {
	msg := fmt.Sprintf("KMS v2 provider %q at %s failed the preflight: %s", e.Provider, e.Endpoint, e.Stage)
	if e.Detail != "" {
		msg += ": " + e.Detail
	}
	return msg + "; " + e.Stage.advice()
}

func (e *PreflightError) Unwrap() error { return e.Err }

func (s PreflightStage) advice() string {
	switch s {
	case PreflightDial:
		return "start the plugin (or fix the endpoint) before installing this configuration, or pass --skip-preflight when preparing it where the plugin is not reachable"
	case PreflightStatus, PreflightVersion, PreflightNoKeyID:
		return "fix the plugin until its Status answers healthz \"ok\", version v2 and a key id, then try again"
	case PreflightTimeout:
		return "the plugin answered too slowly for the provider's timeout: fix the plugin or raise `timeout` in the configuration"
	}
	return "the plugin cannot wrap and unwrap a DEK seed, so an apiserver with this configuration could not write; fix the plugin's key before installing it"
}

// Preflight checks the plugin of KMS v2 provider name at endpoint the way an apiserver is
// about to use it: a Status that is healthy ("ok", a v2 version, a non-empty key id),
// then an Encrypt and Decrypt of a random test plaintext that returns the same bytes.
// Each call, and the round trip as a whole, must finish within timeout (the provider's
// `timeout`). It returns nil or a *PreflightError.
func Preflight(ctx context.Context, name, endpoint string, timeout time.Duration) error {
	if timeout <= 0 {
		timeout = config.DefaultKMSTimeout
	}
	fail := func(stage PreflightStage, detail string, err error) error {
		return &PreflightError{Provider: name, Endpoint: endpoint, Stage: stage, Detail: detail, Err: err}
	}
	addr, err := kmsdial.ParseEndpoint(endpoint)
	if err != nil {
		return fail(PreflightDial, err.Error(), err)
	}
	// The gRPC client waits for a connection until its deadline, so a socket nobody
	// listens on would look like a slow plugin; one plain dial tells them apart.
	d := net.Dialer{Timeout: timeout}
	conn, err := d.DialContext(ctx, "unix", addr)
	if err != nil {
		return fail(PreflightDial, err.Error(), err)
	}
	_ = conn.Close()
	c, err := client.New(endpoint, timeout, nil)
	if err != nil {
		return fail(PreflightDial, err.Error(), err)
	}
	defer c.Close()
	callErr := func(stage PreflightStage, err error) error {
		if status.Code(err) == codes.DeadlineExceeded || errors.Is(err, context.DeadlineExceeded) {
			return fail(PreflightTimeout, fmt.Sprintf("after %s (%s)", timeout, stage), err)
		}
		return fail(stage, err.Error(), err)
	}

	st, err := c.Status(ctx)
	switch {
	case err != nil:
		return callErr(PreflightStatus, err)
	case st.Healthz != "ok":
		return fail(PreflightStatus, st.Healthz, nil)
	case st.Version != state.VersionV2 && st.Version != state.VersionV2beta1:
		return fail(PreflightVersion, fmt.Sprintf("%q, want %q", st.Version, state.VersionV2), nil)
	case st.KeyID == "":
		return fail(PreflightNoKeyID, "Status answered an empty key id", nil)
	}

	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	plaintext := make([]byte, preflightPlaintextSize)
	if _, err := rand.Read(plaintext); err != nil {
		return fmt.Errorf("kms v2 preflight: cannot read random bytes: %w", err)
	}
	enc, err := c.Encrypt(rctx, uuid.NewString(), plaintext)
	if err != nil {
		return callErr(PreflightEncrypt, err)
	}
	if enc.KeyID == "" {
		return fail(PreflightEncrypt, "Encrypt answered an empty key id", nil)
	}
	got, err := c.Decrypt(rctx, uuid.NewString(), enc.KeyID, enc.Ciphertext, enc.Annotations)
	if err != nil {
		return callErr(PreflightDecrypt, err)
	}
	if !bytes.Equal(got, plaintext) {
		return fail(PreflightMismatch, fmt.Sprintf("Decrypt returned %d bytes that differ from the %d encrypted", len(got), len(plaintext)), nil)
	}
	return nil
}

// PreflightConfig runs Preflight for every KMS v2 provider cfg names, in order, and
// returns every failure joined (nil when all pass).
func PreflightConfig(ctx context.Context, cfg *config.Config) error {
	var errs []error
	for _, k := range KMSv2Providers(cfg) {
		errs = append(errs, Preflight(ctx, k.Name, k.Endpoint, k.Timeout))
	}
	return errors.Join(errs...)
}

// KMSv2Providers lists the KMS v2 providers of cfg once each (a name is unique in a
// configuration, but one provider may serve several rules).
func KMSv2Providers(cfg *config.Config) []transformers.ConfigKey {
	var out []transformers.ConfigKey
	seen := map[string]bool{}
	for _, e := range transformers.Describe(cfg) {
		for _, k := range e.Items {
			if k.Provider == transformers.ProviderKMSv2 && !seen[k.Name] {
				seen[k.Name] = true
				out = append(out, k)
			}
		}
	}
	return out
}
