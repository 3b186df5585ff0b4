package reload

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/rekey-io/rekey/internal/leakcheck"
	"github.com/rekey-io/rekey/pkg/config"
)

// traffic writes and reads secrets through the agent until stopped and counts failures.
type traffic struct {
	stop     chan struct{}
	wg       sync.WaitGroup
	calls    atomic.Int64
	failures atomic.Int64
	mu       sync.Mutex
	firstErr error
}

func startTraffic(f *fixture, workers int) *traffic {
	tr := &traffic{stop: make(chan struct{})}
	for w := range workers {
		tr.wg.Add(1)
		go func() {
			defer tr.wg.Done()
			for i := 0; ; i++ {
				select {
				case <-tr.stop:
					return
				default:
				}
				k := fmt.Sprintf("/registry/secrets/ns/w%d-%d", w, i)
				want := fmt.Sprintf("value %d/%d", w, i)
				stored, err := f.write(secrets, k, want)
				if err == nil {
					var got string
					got, _, err = f.read(secrets, k, stored)
					if err == nil && got != want {
						err = fmt.Errorf("read %q, wrote %q", got, want)
					}
				}
				tr.calls.Add(2)
				if err != nil {
					tr.failures.Add(1)
					tr.mu.Lock()
					if tr.firstErr == nil {
						tr.firstErr = fmt.Errorf("%s: %w", k, err)
					}
					tr.mu.Unlock()
				}
			}
		}()
	}
	return tr
}

func (tr *traffic) finish(t testing.TB) {
	t.Helper()
	close(tr.stop)
	tr.wg.Wait()
	if n := tr.failures.Load(); n != 0 {
		t.Fatalf("%d of %d calls failed; first: %v", n, tr.calls.Load(), tr.firstErr)
	}
	if tr.calls.Load() == 0 {
		t.Fatal("no traffic ran")
	}
}

// waitApplied waits until the agent serves content.
func (f *fixture) waitApplied(content string) {
	f.t.Helper()
	want := config.Hash([]byte(content))
	eventually(f.t, "config "+want[:15]+" to be applied", func() bool {
		return f.agent.Status().ActiveConfigHash == want
	})
}

// waitClosed waits until every replaced Set is closed, then checks that every fake
// KMS provider but the serving ones is closed.
func (f *fixture) waitClosed() {
	f.t.Helper()
	eventually(f.t, "replaced configurations to be closed", func() bool {
		return f.agent.Status().ReplacedPendingClose == 0
	})
	serving := map[any]bool{}
	for _, k := range f.agent.cur.Load().set.KMSProviders() {
		serving[k] = true
	}
	for _, k := range f.plugins.all() {
		if !serving[k] && !k.closed.Load() {
			f.t.Fatalf("replaced KMS provider %q still open", k.name)
		}
	}
}

// generationConfig writes with a new KMS provider "gen<n>" and still reads what every
// earlier generation wrote.
func generationConfig(n int) string {
	var list []string
	for g := n; g >= 0; g-- {
		list = append(list, fmt.Sprintf("kms:gen%d", g))
	}
	return secretsConfig(append(list, "aesgcm:k1")...)
}

// Every way a file gets replaced is picked up by the watcher, under
// traffic, with zero failed calls; replaced providers are closed after the grace period
// and writes keep working after it.
func TestFileUpdateWays(t *testing.T) {
	ways := map[string]func(t *testing.T, f *fixture, content string){
		"write in place (O_TRUNC)": func(t *testing.T, f *fixture, content string) {
			if err := os.WriteFile(f.path, []byte(content), 0o600); err != nil {
				t.Fatal(err)
			}
		},
		"truncate then write in two steps": func(t *testing.T, f *fixture, content string) {
			fh, err := os.OpenFile(f.path, os.O_WRONLY|os.O_TRUNC, 0o600)
			if err != nil {
				t.Fatal(err)
			}
			half := len(content) / 2
			if _, err := fh.WriteString(content[:half]); err != nil {
				t.Fatal(err)
			}
			_ = fh.Sync()
			if _, err := fh.WriteString(content[half:]); err != nil {
				t.Fatal(err)
			}
			if err := fh.Close(); err != nil {
				t.Fatal(err)
			}
		},
		"delete and recreate": func(t *testing.T, f *fixture, content string) {
			if err := os.Remove(f.path); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(f.path, []byte(content), 0o600); err != nil {
				t.Fatal(err)
			}
		},
		"temp file and rename": func(t *testing.T, f *fixture, content string) {
			writeRename(t, f.path, content)
		},
	}
	for name, update := range ways {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t, generationConfig(0))
			f.run()
			tr := startTraffic(f, 2)
			for gen := 1; gen <= 3; gen++ {
				content := generationConfig(gen)
				update(t, f, content)
				f.waitApplied(content)
				if p := f.writePrefix(secrets); p != fmt.Sprintf("k8s:enc:kms:v2:gen%d:", gen) {
					t.Fatalf("write prefix %q", p)
				}
			}
			f.waitClosed()
			tr.finish(t)
			f.mustWrite(secrets, "/registry/secrets/ns/after-grace", "x")
		})
	}
	t.Run("kubelet ConfigMap volume symlink swap", func(t *testing.T) {
		dir := t.TempDir()
		const file = "encryption-config.yaml"
		gen := 0
		publish := func(content string) {
			// What kubelet's atomic writer does: a new timestamped directory, a new
			// ..data_tmp symlink renamed over ..data, then the old directory removed.
			gen++
			ts := fmt.Sprintf("..2026_11_22_00_00_%02d.%d", gen, gen)
			if err := os.Mkdir(filepath.Join(dir, ts), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, ts, file), []byte(content), 0o644); err != nil {
				t.Fatal(err)
			}
			old, _ := os.Readlink(filepath.Join(dir, "..data"))
			if err := os.Symlink(ts, filepath.Join(dir, "..data_tmp")); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
				t.Fatal(err)
			}
			if old != "" {
				if err := os.RemoveAll(filepath.Join(dir, old)); err != nil {
					t.Fatal(err)
				}
			}
		}
		publish(generationConfig(0))
		if err := os.Symlink(filepath.Join("..data", file), filepath.Join(dir, file)); err != nil {
			t.Fatal(err)
		}
		f := newFixtureAt(t, dir, filepath.Join(dir, file))
		f.run()
		tr := startTraffic(f, 2)
		for g := 1; g <= 3; g++ {
			content := generationConfig(g)
			publish(content)
			f.waitApplied(content)
		}
		f.waitClosed()
		tr.finish(t)
	})
}

// A file system without events: the poll picks the change up; nothing before it.
func TestPollFallback(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Now())
	f := newFixture(t, secretsConfig("aesgcm:k1"), func(o *Options) {
		o.Clock = clk
		o.PollInterval = time.Minute
	})
	f.agent.pollOnly = true
	f.run()
	// The first pass of Run reads the file once; wait for the poll timer to be armed.
	eventually(t, "Run to arm its poll timer", func() bool {
		return !f.agent.Status().LastAttemptAt.IsZero() && clk.HasWaiters()
	})
	next := secretsConfig("aesgcm:k2")
	writeRename(t, f.path, next)
	clk.Step(59 * time.Second)
	if f.agent.Status().ActiveConfigHash == config.Hash([]byte(next)) {
		t.Fatal("applied before the poll interval")
	}
	clk.Step(time.Second)
	f.waitApplied(next)
}

// A refused change is retried with backoff without any file event, and a new file
// event is acted on at once.
func TestRetryBackoffAndEventAfterFailure(t *testing.T) {
	f := newFixture(t, secretsConfig("aesgcm:k1"), func(o *Options) { o.HealthGateTimeout = 50 * time.Millisecond })
	f.plugins.setDown("vault", fmt.Errorf("plugin starting"))
	f.run()
	writeRename(t, f.path, secretsConfig("kms:vault"))
	eventually(t, "the refused change to be recorded", func() bool { return f.agent.Status().ReloadsFailed >= 1 })
	// A newer good file is applied on its event, not after the backoff.
	good := secretsConfig("aesgcm:k2")
	writeRename(t, f.path, good)
	f.waitApplied(good)
	// Back to the KMS config; it fails until the plugin is up, then a retry applies it.
	kms := secretsConfig("kms:vault", "aesgcm:k2")
	writeRename(t, f.path, kms)
	eventually(t, "the second refusal", func() bool { return f.agent.Status().LastErrorConfigHash == config.Hash([]byte(kms)) })
	f.plugins.setDown("vault", nil)
	f.waitApplied(kms)
}

// A burst of events is read once. The debounce is a second, not the 50 ms it could be
// on an idle machine: the burst is this goroutine's writes one line at a time, and a
// test process starved of CPU for more than the debounce between two of them (the
// race group beside three others on two cores) reads a half-written file.
func TestDebounce(t *testing.T) {
	f := newFixture(t, secretsConfig("aesgcm:k1"), func(o *Options) { o.Debounce = time.Second })
	f.run()
	eventually(t, "the first pass", func() bool { return !f.agent.Status().LastAttemptAt.IsZero() })
	first := f.agent.Status().LastAttemptAt
	content := secretsConfig("aesgcm:k2")
	fh, err := os.OpenFile(f.path, os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.SplitAfter(content, "\n") {
		if _, err := fh.WriteString(line); err != nil {
			t.Fatal(err)
		}
	}
	fh.Close()
	f.waitApplied(content)
	st := f.agent.Status()
	if st.ReloadsFailed != 0 || st.ReloadsSucceeded != 1 || !st.LastAttemptAt.After(first) {
		t.Fatalf("a write burst caused %d failed and %d applied reloads", st.ReloadsFailed, st.ReloadsSucceeded)
	}
}

// A call that started on the old Set finishes on it, even past the grace period;
// the old Set is closed when the call returns.
func TestInFlightCallOutlivesGrace(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Now())
	f := newFixture(t, secretsConfig("kms:old"), func(o *Options) {
		o.Clock = clk
		o.GracePeriod = time.Second
	})
	block := make(chan struct{})
	f.plugins.mu.Lock()
	f.plugins.blockSeal = block
	f.plugins.mu.Unlock()
	result := make(chan error, 1)
	var stored []byte
	go func() {
		var err error
		stored, err = f.write(secrets, "/registry/secrets/ns/slow", "slow")
		result <- err
	}()
	eventually(t, "the call to start on the old Set", func() bool { return f.agent.cur.Load().inflight.Load() == 1 })
	f.plugins.mu.Lock()
	f.plugins.blockSeal = nil
	f.plugins.mu.Unlock()

	if err := os.WriteFile(f.path, []byte(secretsConfig("kms:new")), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	old := f.plugins.all()[0]
	eventually(t, "the grace timer", clk.HasWaiters)
	clk.Step(time.Second) // the grace period ends with the call still running
	eventually(t, "the closer to wait for the call", func() bool { return clk.HasWaiters() && f.agent.pending.Load() == 1 })
	if old.closed.Load() {
		t.Fatal("old provider closed under a running call")
	}
	close(block)
	if err := <-result; err != nil {
		t.Fatalf("in-flight call failed: %v", err)
	}
	if !strings.HasPrefix(string(stored), "k8s:enc:kms:v2:old:") {
		t.Fatalf("in-flight call did not finish on the Set it started with: %q", stored)
	}
	eventually(t, "the old provider to be closed", old.closed.Load)
	eventually(t, "no replaced Set pending", func() bool { return f.agent.pending.Load() == 0 })
}

// Without calls running, the old Set is closed exactly when the grace period ends.
func TestClosedAfterGrace(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Now())
	f := newFixture(t, secretsConfig("kms:old"), func(o *Options) {
		o.Clock = clk
		o.GracePeriod = 10 * time.Second
	})
	writeRename(t, f.path, secretsConfig("kms:new"))
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	old := f.plugins.all()[0]
	eventually(t, "the grace timer", clk.HasWaiters)
	clk.Step(10*time.Second - time.Millisecond)
	if old.closed.Load() {
		t.Fatal("closed before the grace period")
	}
	clk.Step(time.Millisecond)
	eventually(t, "the old provider to be closed", old.closed.Load)
	if f.plugins.all()[1].closed.Load() {
		t.Fatal("new provider closed")
	}
}

// Close closes the current Set and every replaced one still in its grace period.
func TestCloseClosesEverything(t *testing.T) {
	f := newFixture(t, secretsConfig("kms:a"), func(o *Options) { o.GracePeriod = time.Hour })
	writeRename(t, f.path, secretsConfig("kms:b"))
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	f.agent.Close()
	for _, k := range f.plugins.all() {
		if !k.closed.Load() {
			t.Fatalf("%s open after Close", k.name)
		}
	}
	if err := f.agent.Reload(context.Background()); err == nil {
		t.Fatal("Reload after Close succeeded")
	}
	f.agent.Close()
	leakcheck.Verify(t)
}

// 500 reloads under concurrent readers and writers: zero failed calls, every reload
// applied, every replaced provider closed, no goroutine left behind.
func TestReloadStorm(t *testing.T) {
	const reloads = 500
	providers := []string{"aesgcm:k0,k1", "aescbc:c0", "secretbox:s0", "kms:vault", "identity"}
	content := func(i int) string {
		// Rotate which provider writes; every one stays readable.
		list := append(append([]string(nil), providers[i%len(providers):]...), providers[:i%len(providers)]...)
		if list[0] == "identity" { // identity in front would read encrypted data as stale only
			list = append(list[1:], list[0])
		}
		return fmt.Sprintf("# generation %d\n", i) + secretsConfig(list...)
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "encryption-config.yaml")
	writeRename(t, path, content(0))
	f := newFixtureAt(t, dir, path, func(o *Options) {
		o.GracePeriod = time.Millisecond // close replaced Sets while calls are running on them
		o.Debounce = time.Millisecond
	})
	stopRun := f.run() // the watcher races the explicit reloads below
	tr := startTraffic(f, 3)
	start := time.Now()
	for i := 1; i <= reloads; i++ {
		writeRename(t, path, content(i))
		if err := f.agent.Reload(context.Background()); err != nil {
			t.Fatalf("reload %d: %v", i, err)
		}
	}
	took := time.Since(start)
	f.waitApplied(content(reloads))
	f.waitClosed()
	tr.finish(t)
	st := f.agent.Status()
	if st.ReloadsFailed != 0 || st.ReloadsSucceeded < reloads {
		t.Fatalf("reloads: %d applied, %d failed", st.ReloadsSucceeded, st.ReloadsFailed)
	}
	t.Logf("%d reloads in %v with %d concurrent calls, 0 failed", reloads, took, tr.calls.Load())
	stopRun()
	f.agent.Close()
	leakcheck.Verify(t)
}
