package kmsv2

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/status"

	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/client"
)

// outage is a run of failures to reach the plugin: from a Status of the loop or a
// read's Decrypt, until either reaches it again. It is replaced, never changed, so
// reads load it without a lock.
type outage struct {
	// since is when the first failure of the run was seen.
	since time.Time
	// err is the latest failure.
	err error
	// hung: a Status found a connection to the plugin but no answer within the
	// timeout; a read would wait as long, so reads do not call until a Status answers.
	hung bool
}

// noteStatus records what a Status asked at askedAt says about reaching the plugin. It
// runs on the loop.
func (p *Provider) noteStatus(askedAt time.Time, err error) {
	if !transformers.PluginUnreachable(err) {
		if errors.Is(err, context.Canceled) {
			return // the provider is closing
		}
		if p.down.Swap(nil) != nil {
			p.log.Info("The KMS plugin answers again", "endpoint", p.endpoint)
		}
		return
	}
	// A deadline on a connection that is up is a plugin that does not answer; on one
	// that is not, a plugin nobody could connect to (Status waits for a connection).
	deadline := status.Code(err) == codes.DeadlineExceeded || errors.Is(err, context.DeadlineExceeded)
	hung := deadline && p.client.State() == connectivity.Ready
	if p.noteUnreachable(askedAt, err, hung) {
		p.log.Info("The KMS plugin cannot be reached; reads of values whose DEK is not cached fail at once until it answers again",
			"endpoint", p.endpoint, "err", err)
	}
}

// noteRead records the outcome of a read's Decrypt: a failure to reach the plugin
// starts or continues an outage, an answer ends one that a read saw (a hung plugin's
// ends with a Status: reads do not call it).
func (p *Provider) noteRead(err error) {
	if transformers.PluginUnreachable(err) {
		p.noteUnreachable(time.Unix(0, p.coarseNow.Load()), err, false)
		return
	}
	if status.Code(err) == codes.Canceled || errors.Is(err, context.Canceled) {
		return // the caller gave up: nothing learnt
	}
	if o := p.down.Load(); o != nil && !o.hung {
		p.down.CompareAndSwap(o, nil)
	}
}

// noteUnreachable starts an outage at at, or continues the current one; it reports
// whether it started one.
func (p *Provider) noteUnreachable(at time.Time, err error, hung bool) bool {
	for {
		prev := p.down.Load()
		next := &outage{since: at, err: err, hung: hung}
		if prev != nil {
			next.since = prev.since
		}
		if p.down.CompareAndSwap(prev, next) {
			return prev == nil
		}
	}
}

// readCallOptions are the call options of a read's Decrypt: it never waits for a
// connection. A plugin that answers is reached as with waiting (a connection being
// made is waited for, a few milliseconds on a unix socket); one that is absent or gone
// fails the read at once with codes.Unavailable instead of after the KMS timeout, and
// the next read after it returns succeeds once the client has reconnected (within a
// second: client.Dial's backoff).
func (p *Provider) readCallOptions() []grpc.CallOption {
	return []grpc.CallOption{client.FailFast()}
}

// Unavailable is nil while the plugin can be reached as far as the provider knows, and
// otherwise an error (matching transformers.ErrKMSUnavailable) that names the provider,
// the endpoint, since when and why (transformers.UnavailableReporter). Reads of values
// whose DEK is not cached fail with such an error at once; a storage layer may name it
// for requests that cannot be answered meanwhile (a watch cache that cannot fill).
func (p *Provider) Unavailable() error {
	if o := p.down.Load(); o != nil {
		return transformers.Unavailable(fmt.Errorf("kms v2 provider %q: the plugin at %s is unavailable since %s: %w",
			p.name, p.endpoint, o.since.UTC().Format(time.RFC3339), o.err))
	}
	if p.client.State() == connectivity.TransientFailure {
		return transformers.Unavailable(fmt.Errorf("kms v2 provider %q: the plugin at %s is unavailable: the last attempt to connect to it failed",
			p.name, p.endpoint))
	}
	return nil
}

// readUnavailable is the error of a read whose DEK source needs the plugin: at once,
// without a call, while Status found it hung; nil when the read may call it.
func (p *Provider) readUnavailable() error {
	if o := p.down.Load(); o != nil && o.hung {
		return fmt.Errorf("%w; values whose DEK is not cached cannot be read until it answers a Status again", p.Unavailable())
	}
	return nil
}

// decryptFailed is the error of a read's Decrypt that failed with err: one that did
// not reach the plugin names the provider, the endpoint and since when, and matches
// transformers.ErrKMSUnavailable.
func (p *Provider) decryptFailed(err error, keyIDHash, uid string) error {
	if !transformers.PluginUnreachable(err) {
		return fmt.Errorf("failed to decrypt DEK, error: %w (kms v2 provider %q, keyID hash %q, uid %s)", err, p.name, keyIDHash, uid)
	}
	since := ""
	if o := p.down.Load(); o != nil {
		since = " since " + o.since.UTC().Format(time.RFC3339)
	}
	return transformers.Unavailable(fmt.Errorf("kms v2 provider %q: the plugin at %s is unavailable%s: %w; values whose DEK is not cached cannot be read until it answers (keyID hash %q, uid %s)",
		p.name, p.endpoint, since, err, keyIDHash, uid))
}
