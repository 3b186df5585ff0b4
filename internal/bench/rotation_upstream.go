package bench

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/rekey-io/rekey/internal/testbed"
)

// The rotation scenario's upstream side: upstream's documented procedure, scripted as an
// operator would run it with kubectl.

// rotateUpstream follows upstream's documented rotation of a local key, scripted, and
// returns when every apiserver reports the final config's hash.
func rotateUpstream(ctx context.Context, progress io.Writer, b *hostedBed, source string, key1 testbed.NamedKey) (time.Time, []byte, rewriteTally, error) {
	key2 := testbed.NamedKey{Name: "key2", Secret: testbed.RandomKey()}
	step := func(what string, cfg testbed.EncryptionConfig) (time.Time, error) {
		content := cfg.Render()
		start := time.Now()
		if err := testbed.WriteFileAtomic(source, content); err != nil {
			return time.Time{}, err
		}
		at, err := waitConfigHash(ctx, b.fleet, content, rotationTimeout)
		if err != nil {
			return time.Time{}, fmt.Errorf("%s: %w", what, err)
		}
		fmt.Fprintf(progress, "rotation: upstream: %s: every apiserver reports the new hash after %v\n", what, at.Sub(start).Round(time.Millisecond))
		return at, nil
	}
	if _, err := step("key2 added as a read key", testbed.SecretsConfig(testbed.AESGCM(key1, key2))); err != nil {
		return time.Time{}, nil, rewriteTally{}, err
	}
	promoted := testbed.SecretsConfig(testbed.AESGCM(key2, key1))
	if _, err := step("key2 promoted to write key", promoted); err != nil {
		return time.Time{}, nil, rewriteTally{}, err
	}
	start := time.Now()
	b.clients.rewrite(true)
	n, conflicts, err := rewriteSecrets(ctx, b.fleet)
	b.clients.rewrite(false)
	if err != nil {
		return time.Time{}, nil, rewriteTally{}, err
	}
	fmt.Fprintf(progress, "rotation: upstream: %d Secrets rewritten (no-op updates, %d workers) in %v, %d conflicts retried\n",
		n, rewriteWorkers, time.Since(start).Round(time.Millisecond), conflicts)
	final := testbed.SecretsConfig(testbed.AESGCM(key2))
	done, err := step("key1 removed", final)
	return done, final.Render(), rewriteTally{rewritten: n, conflicts: conflicts}, err
}
