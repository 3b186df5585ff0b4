package bench

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/rekey-io/rekey/internal/testbed"
)

// The rotation scenario (issue 12, item 4) rotates the local key of 10,000 Secrets on
// three apiservers twice, each time on a fresh testbed, in one run:
//
//   - rekey: the shims run rekey's layer; `rekey rotate --wait` edits the source file
//     once and follows the cluster until the old key is removed everywhere.
//   - upstream: the shims run k8s.io/apiserver's layer (--encryption-layer=upstream,
//     its 1-minute file poll untouched) and a script follows upstream's documented
//     procedure: add the key for reads, wait until every apiserver reports the new
//     config hash, promote it, wait, rewrite every Secret through the API, remove the
//     old key, wait.
//
// Both sides edit one source file, which a kubelet-like syncer copies to each
// apiserver's own file after its own random delay (0–10 s, random order), while
// writers update Secrets through every apiserver and a sampler reads every Secret
// through every apiserver.
const (
	rotationScenario = "rotation (10,000 Secrets, 3 apiservers, 3-member etcd)"
	// lastConfigInfo is the metric both layers expose with the hash of the config they
	// serve: "sha256:" and the hex SHA-256 of the file's bytes (k8s.io/apiserver's
	// encryptionconfig computeEncryptionConfigHash, and pkg/config.Hash). Its name is
	// BuildFQName("apiserver", "encryption_config_controller", "last_config_info") in
	// k8s.io/apiserver's encryptionconfig/metrics: there is no "automatic_reload" in it.
	lastConfigInfo = "apiserver_encryption_config_controller_last_config_info"
	// rotationPrefix is the shims' --etcd-prefix: rekey rotate's default.
	rotationPrefix = "/registry"
	// rewriteWorkers is the upstream script's concurrency for the no-op updates, as an
	// operator's `xargs -P 8` around kubectl would run.
	rewriteWorkers = 8
	// rotationTimeout bounds one side's rotation; upstream's needs about four minutes.
	rotationTimeout = 15 * time.Minute
)

// RotationSides are the sides the rotation scenario can run.
var rotationSides = []string{"rekey", "upstream"}

// errNoWait is what side (a) reports when the rekey binary predates rotate --wait.
var errNoWait = errors.New("rotate --wait not supported by this rekey binary: build cmd/rekey from a commit that has it (issue 12, item 1)")

// rotationResult is what one side measured.
type rotationResult struct {
	side string
	// total is from the first edit of the source file to "old key removed everywhere";
	// afterLastFile is from the last per-apiserver file update of the first edit.
	total, afterLastFile time.Duration
	edits                int
	writes               testbed.WriteReport
	reads                testbed.SampleReport
	// underNew of stored Secrets are under the new key at the end (etcd scan).
	underNew, stored int
	newKey           string
	// rewritten and rewriteConflicts are the upstream script's no-op updates.
	rewritten, rewriteConflicts int64
}

func runRotation(s Settings) ([]Row, error) {
	objects := s.RotationObjects
	if objects <= 0 {
		objects = 10_000
		if s.Short {
			objects = 1_000
		}
	}
	sides := s.RotationSides
	if len(sides) == 0 {
		sides = rotationSides
	}
	for _, side := range sides {
		if !slices.Contains(rotationSides, side) {
			return nil, fmt.Errorf("rotation side %q: must be one of %v", side, rotationSides)
		}
	}
	// An interrupted run stops its etcd members and shims (their own process groups
	// do not get the terminal's signal).
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	dir, err := os.MkdirTemp("", "rkr")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	progress := s.Progress
	if progress == nil {
		progress = io.Discard
	}
	fmt.Fprintln(progress, "rotation: building the shim, etcd and rekey binaries")
	bins, err := testbed.Build(ctx, filepath.Join(dir, "bin"))
	if err != nil {
		return nil, err
	}
	rekeyBin := s.RotationRekeyBin
	if rekeyBin == "" {
		if rekeyBin, err = buildRekey(ctx, filepath.Join(dir, "bin")); err != nil {
			return nil, err
		}
	}
	if slices.Contains(sides, "rekey") {
		// Refuse before minutes of setup, not after.
		if err := checkRotateWait(ctx, rekeyBin); err != nil {
			return nil, err
		}
	}
	results := map[string]*rotationResult{}
	for _, side := range sides {
		fmt.Fprintf(progress, "rotation: side %s, %d Secrets\n", side, objects)
		r, err := rotateOnce(ctx, progress, filepath.Join(dir, side), bins, rekeyBin, side, objects)
		if err != nil {
			return nil, fmt.Errorf("rotation side %s: %w", side, err)
		}
		fmt.Fprintf(progress, "rotation: %s: %v from the first edit (%v after the last file update), %d edits; writers: %s; sampler: %s; %d of %d stored Secrets under %s\n",
			side, r.total.Round(time.Millisecond), r.afterLastFile.Round(time.Millisecond), r.edits, r.writes, r.reads, r.underNew, r.stored, r.newKey)
		results[side] = r
	}
	return rotationRows(results, objects), nil
}

// rotationRows turns the sides' results into rows: rekey first, upstream second, a
// side that did not run noted as such.
func rotationRows(res map[string]*rotationResult, objects int) []Row {
	scenario := rotationScenario
	if objects != 10_000 {
		scenario = strings.Replace(scenario, "10,000", groupThousands(int64(objects)), 1)
	}
	fig := func(side, unit string, v float64) Figure {
		f := Figure{Impl: side, Unit: unit, Stats: Stats{Median: v, Min: v, Max: v}, Allocs: -1, Bytes: -1, Retained: -1}
		if res[side] == nil {
			f.Note = "not run"
		}
		return f
	}
	impls := []string{"rekey rotate --wait", "upstream procedure"}
	row := func(c string, unit string, value func(*rotationResult) float64) Row {
		r := Row{Scenario: scenario, Case: c}
		for i, side := range rotationSides {
			v := 0.0
			if res[side] != nil {
				v = value(res[side])
			}
			r.Figures = append(r.Figures, fig(side, unit, v))
			r.Figures[i].Impl = impls[i]
		}
		return r
	}
	both := res["rekey"] != nil && res["upstream"] != nil
	plot := func(x string, of func(*rotationResult) time.Duration) []Plot {
		if !both {
			return nil
		}
		// The absolute times under the ratio: a reader sees both.
		x += fmt.Sprintf("\n(%.0f s vs %.0f s)", of(res["rekey"]).Seconds(), of(res["upstream"]).Seconds())
		return []Plot{{Chart: "rotation", Title: fmt.Sprintf("Key rotation of %s Secrets on 3 apiservers: rekey rotate --wait vs upstream's procedure", groupThousands(int64(objects))),
			X: x, Series: "rekey rotate --wait (same testbed, same run)", Against: 1}}
	}
	secs := func(d time.Duration) float64 { return d.Seconds() }

	total := row("first edit → old key removed everywhere", "s", func(r *rotationResult) float64 { return secs(r.total) })
	total.Plots = plot("first edit →\nold key removed", func(r *rotationResult) time.Duration { return r.total })
	if both {
		total.Checks = []Check{evaluate(total, Target{Desc: "≥ 5× faster than upstream", Against: 1, MinSpeedup: 5})}
	}
	after := row("last file update of the first edit → old key removed everywhere", "s", func(r *rotationResult) float64 { return secs(r.afterLastFile) })
	after.Plots = plot("last file update →\nold key removed", func(r *rotationResult) time.Duration { return r.afterLastFile })
	if r := res["rekey"]; r != nil {
		after.Checks = []Check{{Desc: "rekey < 60 s", Met: r.afterLastFile < 60*time.Second, Got: fmt.Sprintf("%.1f s", r.afterLastFile.Seconds())}}
	}
	edits := row("edits of the source file", "edits", func(r *rotationResult) float64 { return float64(r.edits) })
	failed := row("writer requests failed (writers on every apiserver)", "requests", func(r *rotationResult) float64 { return float64(r.writes.Failed()) })
	unreadable := row("unreadable reads (sampler, every Secret through every apiserver)", "reads", func(r *rotationResult) float64 { return float64(r.reads.Total().Unreadable) })
	under := row("stored Secrets under the new key at the end (etcd scan)", "%", func(r *rotationResult) float64 {
		if r.stored == 0 {
			return 0
		}
		return 100 * float64(r.underNew) / float64(r.stored)
	})
	for i := range under.Figures {
		under.Figures[i].HigherIsBetter = true
	}
	for _, side := range rotationSides {
		r := res[side]
		if r == nil {
			continue
		}
		failed.Checks = append(failed.Checks, Check{Desc: side + ": 0 failed", Met: r.writes.Failed() == 0,
			Got: fmt.Sprintf("%d of %d", r.writes.Failed(), r.writes.Failed()+r.writes.Acked())})
		var per []string
		for _, ep := range slices.Sorted(maps.Keys(r.reads.PerEndpoint)) {
			per = append(per, fmt.Sprint(r.reads.PerEndpoint[ep].Unreadable))
		}
		unreadable.Checks = append(unreadable.Checks, Check{Desc: side + ": 0 unreadable", Met: r.reads.Total().Unreadable == 0,
			Got: fmt.Sprintf("per apiserver %s; %d reads in all", strings.Join(per, " / "), r.reads.Total().Reads)})
		under.Checks = append(under.Checks, Check{Desc: side + ": every stored Secret", Met: r.underNew == r.stored && r.stored > 0,
			Got: fmt.Sprintf("%d of %d", r.underNew, r.stored)})
	}
	if r := res["upstream"]; r != nil {
		under.Checks = append(under.Checks, Check{Desc: "upstream's rewrite", Met: true,
			Got: fmt.Sprintf("%d no-op updates, %d conflicts retried", r.rewritten, r.rewriteConflicts)})
	}
	return []Row{total, after, edits, failed, unreadable, under}
}

// buildRekey compiles cmd/rekey into dir.
func buildRekey(ctx context.Context, dir string) (string, error) {
	root, err := testbed.ModuleRoot()
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "rekey")
	cmd := exec.CommandContext(ctx, "go", "build", "-ldflags", testbed.VersionLDFlags, "-o", bin, "./cmd/rekey")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/rekey: %w\n%s", err, out)
	}
	return bin, nil
}

// checkRotateWait returns errNoWait when `rekey rotate --help` lists no --wait.
func checkRotateWait(ctx context.Context, bin string) error {
	out, err := exec.CommandContext(ctx, bin, "rotate", "--help").CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s rotate --help: %w\n%s", bin, err, out)
	}
	if !rotateHelpHasWait(string(out)) {
		return errNoWait
	}
	return nil
}

func rotateHelpHasWait(help string) bool {
	for _, l := range strings.Split(help, "\n") {
		f := strings.Fields(l)
		if len(f) > 0 && (f[0] == "--wait" || strings.HasPrefix(f[0], "--wait=")) {
			return true
		}
	}
	return false
}

// rotationBed is one side's fresh testbed.
type rotationBed struct {
	etcd   *testbed.EtcdCluster
	fleet  *testbed.Fleet
	load   *testbed.Workload
	source *testbed.SourceFollower
}

func (b *rotationBed) stop() {
	if b.fleet != nil {
		b.fleet.Stop()
	}
	if b.etcd != nil {
		b.etcd.Stop()
	}
}

// rotateOnce starts a fresh testbed for side, seeds objects Secrets under key1, starts
// the load and rotates.
func rotateOnce(ctx context.Context, progress io.Writer, dir string, bins testbed.Binaries, rekeyBin, side string, objects int) (*rotationResult, error) {
	b := &rotationBed{}
	defer b.stop()
	var err error
	if b.etcd, err = testbed.StartEtcdCluster(ctx, bins.Etcd, filepath.Join(dir, "etcd"), 3); err != nil {
		return nil, err
	}
	cli, err := b.etcd.Client()
	if err != nil {
		return nil, err
	}
	defer cli.Close()
	key1 := testbed.NamedKey{Name: "key1", Secret: testbed.RandomKey()}
	initial := testbed.SecretsConfig(testbed.AESGCM(key1)).Render()
	b.fleet, err = testbed.StartFleet(ctx, testbed.FleetConfig{
		ShimBin: bins.Shim, Dir: filepath.Join(dir, "shims"), N: 3,
		EtcdServers: b.etcd.Endpoints(), EtcdPrefix: rotationPrefix,
		Layer: side, Config: initial,
	})
	if err != nil {
		return nil, err
	}
	syncer, err := b.fleet.NewSyncer(testbed.SyncerConfig{MaxDelay: 10 * time.Second,
		Logf: func(format string, args ...any) {
			fmt.Fprintf(progress, "rotation: %s: "+format+"\n", append([]any{side}, args...)...)
		}})
	if err != nil {
		return nil, err
	}
	sourcePath := filepath.Join(dir, "source", "encryption.yaml")
	if err := os.MkdirAll(filepath.Dir(sourcePath), 0o700); err != nil {
		return nil, err
	}
	if err := os.WriteFile(sourcePath, initial, 0o600); err != nil {
		return nil, err
	}
	b.load = testbed.NewWorkload("rotation", b.fleet.Endpoints())
	seedStart := time.Now()
	if err := b.load.Seed(ctx, "s", objects, 8); err != nil {
		return nil, err
	}
	fmt.Fprintf(progress, "rotation: %s: %d Secrets under key1 in %v\n", side, objects, time.Since(seedStart).Round(time.Millisecond))
	writers := b.load.StartWriters(ctx, testbed.WritersConfig{PerEndpoint: 2, Pause: 20 * time.Millisecond, CreateEvery: 50})
	sampler := b.load.StartSampler(ctx, testbed.SamplerConfig{Rate: 200})
	stopLoad := func() (testbed.WriteReport, testbed.SampleReport) { return writers.Stop(), sampler.Stop() }

	rctx, cancel := context.WithTimeout(ctx, rotationTimeout)
	defer cancel()
	b.source = testbed.FollowSource(rctx, sourcePath, initial, syncer)
	res := &rotationResult{side: side}
	var done time.Time
	var final []byte
	switch side {
	case "rekey":
		done, final, err = rotateRekey(rctx, progress, b, rekeyBin, sourcePath)
	case "upstream":
		done, final, err = rotateUpstream(rctx, progress, b, sourcePath, key1, res)
	}
	b.source.Stop()
	res.writes, res.reads = stopLoad()
	if err != nil {
		return nil, fmt.Errorf("%w\n%s", err, b.fleet.LogTails(2000))
	}
	rounds := b.source.Rounds()
	if len(rounds) == 0 {
		return nil, errors.New("the source file was never edited")
	}
	res.edits = len(rounds)
	first := rounds[0]
	lastFile, err := first.Round.Wait(ctx)
	if err != nil {
		return nil, err
	}
	res.total, res.afterLastFile = done.Sub(first.Detected), done.Sub(lastFile)

	// The end state, checked independently of the procedure that claimed it.
	keys, err := testbed.AESGCMKeyNames(final)
	if err != nil {
		return nil, err
	}
	if slices.Contains(keys, key1.Name) || len(keys) == 0 {
		return nil, fmt.Errorf("the final source config still has %v: the old key was not removed", keys)
	}
	res.newKey = keys[0]
	stored, err := testbed.StoredPrefixes(ctx, cli, rotationPrefix+"/secrets/")
	if err != nil {
		return nil, err
	}
	want := "k8s:enc:aesgcm:v1:" + res.newKey + ":"
	for p, n := range stored {
		res.stored += n
		if p == want {
			res.underNew += n
		}
	}
	for _, ep := range b.fleet.Endpoints() {
		rep, err := b.load.Verify(ctx, ep)
		if err != nil {
			return nil, err
		}
		if !rep.OK() {
			return nil, fmt.Errorf("lost or overwritten writes after the rotation: %s", rep)
		}
	}
	return res, nil
}

// rotateRekey runs `rekey rotate --wait` on the source file and returns when it exited
// 0 and every apiserver reports the final config's hash.
func rotateRekey(ctx context.Context, progress io.Writer, b *rotationBed, bin, source string) (time.Time, []byte, error) {
	cmd := exec.CommandContext(ctx, bin, "rotate", "--encryption-provider-config", source, "--wait",
		"--etcd-servers", strings.Join(b.etcd.Endpoints(), ","), "--progress", "plain")
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	var tail tailBuffer
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			fmt.Fprintf(progress, "rotation: rekey rotate: %s\n", sc.Text())
			tail.add(sc.Text())
		}
		_, _ = io.Copy(io.Discard, pr)
	}()
	err := cmd.Run()
	exited := time.Now()
	pw.Close()
	<-copied
	if err != nil {
		if strings.Contains(tail.String(), "unknown flag: --wait") {
			return time.Time{}, nil, errNoWait
		}
		return time.Time{}, nil, fmt.Errorf("rekey rotate --wait: %w\n%s", err, tail.String())
	}
	final, err := os.ReadFile(source)
	if err != nil {
		return time.Time{}, nil, err
	}
	// rotate's exit claims every apiserver serves the final config; the metric each
	// apiserver exposes must agree (it may only lag by the poll below).
	seen, err := waitConfigHash(ctx, b.fleet, final, 30*time.Second)
	if err != nil {
		return time.Time{}, nil, fmt.Errorf("rekey rotate --wait exited 0, but: %w", err)
	}
	if seen.After(exited) {
		exited = seen
	}
	return exited, final, nil
}

// rotateUpstream follows upstream's documented rotation of a local key, scripted.
func rotateUpstream(ctx context.Context, progress io.Writer, b *rotationBed, source string, key1 testbed.NamedKey, res *rotationResult) (time.Time, []byte, error) {
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
		return time.Time{}, nil, err
	}
	promoted := testbed.SecretsConfig(testbed.AESGCM(key2, key1))
	if _, err := step("key2 promoted to write key", promoted); err != nil {
		return time.Time{}, nil, err
	}
	start := time.Now()
	n, conflicts, err := rewriteSecrets(ctx, b.fleet)
	if err != nil {
		return time.Time{}, nil, err
	}
	res.rewritten, res.rewriteConflicts = n, conflicts
	fmt.Fprintf(progress, "rotation: upstream: %d Secrets rewritten (no-op updates, %d workers) in %v, %d conflicts retried\n",
		n, rewriteWorkers, time.Since(start).Round(time.Millisecond), conflicts)
	final := testbed.SecretsConfig(testbed.AESGCM(key2))
	done, err := step("key1 removed", final)
	return done, final.Render(), err
}

// rewriteSecrets does what `kubectl get secrets -A -o json | kubectl replace -f -`
// does, with rewriteWorkers requests in flight spread over the apiservers as a load
// balancer would: it lists every Secret, then reads and writes back each one
// unchanged, re-reading after a conflict (a writer got there first). An unchanged
// update is stored again because its stored value was read with a key that no longer
// writes.
func rewriteSecrets(ctx context.Context, fleet *testbed.Fleet) (rewritten, conflicts int64, err error) {
	eps := fleet.Endpoints()
	clients := make([]kubernetes.Interface, len(eps))
	for i, ep := range eps {
		if clients[i], err = ep.Client(); err != nil {
			return 0, 0, err
		}
	}
	type ref struct{ ns, name string }
	var all []ref
	opts := metav1.ListOptions{Limit: 500}
	for {
		l, err := clients[0].CoreV1().Secrets(metav1.NamespaceAll).List(ctx, opts)
		if err != nil {
			return 0, 0, fmt.Errorf("listing Secrets: %w", err)
		}
		for _, s := range l.Items {
			all = append(all, ref{s.Namespace, s.Name})
		}
		if l.Continue == "" {
			break
		}
		opts.Continue = l.Continue
	}
	var next, done, conf atomic.Int64
	errs := make([]error, rewriteWorkers)
	var wg sync.WaitGroup
	for w := range rewriteWorkers {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= len(all) || ctx.Err() != nil {
					return
				}
				secrets := clients[i%len(clients)].CoreV1().Secrets(all[i].ns)
				c, err := noopUpdate(ctx, secrets, all[i].name)
				conf.Add(c)
				if err != nil {
					errs[w] = fmt.Errorf("rewriting %s/%s: %w", all[i].ns, all[i].name, err)
					return
				}
				done.Add(1)
			}
		})
	}
	wg.Wait()
	return done.Load(), conf.Load(), errors.Join(errs...)
}

type secretClient interface {
	Get(ctx context.Context, name string, opts metav1.GetOptions) (*corev1.Secret, error)
	Update(ctx context.Context, s *corev1.Secret, opts metav1.UpdateOptions) (*corev1.Secret, error)
}

// noopUpdate reads name and writes it back unchanged, retrying conflicts; it returns
// the number of conflicts.
func noopUpdate(ctx context.Context, secrets secretClient, name string) (int64, error) {
	var conflicts int64
	for attempt := 0; attempt < 20; attempt++ {
		cur, err := secrets.Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return conflicts, nil // deleted since the list: nothing to rewrite
		}
		if err != nil {
			return conflicts, err
		}
		_, err = secrets.Update(ctx, cur, metav1.UpdateOptions{})
		if err == nil {
			return conflicts, nil
		}
		if !apierrors.IsConflict(err) {
			return conflicts, err
		}
		conflicts++
	}
	return conflicts, fmt.Errorf("%d conflicts in a row", conflicts)
}

// waitConfigHash polls every shim's /metrics until its last_config_info metric shows
// the hash of content, and returns when the last one did.
func waitConfigHash(ctx context.Context, fleet *testbed.Fleet, content []byte, timeout time.Duration) (time.Time, error) {
	want := testbed.ConfigHash(content)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	shims := fleet.Running()
	clients := make([]*http.Client, len(shims))
	for i, s := range shims {
		c, err := s.HTTPClient(true)
		if err != nil {
			return time.Time{}, err
		}
		defer c.CloseIdleConnections()
		clients[i] = c
	}
	pending := map[int]string{}
	for i := range shims {
		pending[i] = "not asked yet"
	}
	for {
		for i := range pending {
			got, err := configHashes(ctx, clients[i], shims[i].URL)
			switch {
			case err != nil:
				pending[i] = err.Error()
			case len(got) > 0 && !slices.ContainsFunc(got, func(h string) bool { return h != want }):
				delete(pending, i)
			default:
				pending[i] = fmt.Sprintf("reports %v", got)
			}
		}
		if len(pending) == 0 {
			return time.Now(), nil
		}
		select {
		case <-ctx.Done():
			var why []string
			for i, p := range pending {
				why = append(why, shims[i].Name+": "+p)
			}
			slices.Sort(why)
			return time.Time{}, fmt.Errorf("waiting for every apiserver's %s to show %s: %w (%s)", lastConfigInfo, want, ctx.Err(), strings.Join(why, "; "))
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// configHashes returns the hash labels of the last_config_info samples of one
// apiserver's /metrics.
func configHashes(ctx context.Context, c *http.Client, url string) ([]string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("/metrics: %s", resp.Status)
	}
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	return parseConfigHashes(body), nil
}

// parseConfigHashes picks the hash label out of every last_config_info sample of a
// Prometheus text exposition.
func parseConfigHashes(body []byte) []string {
	var out []string
	for _, line := range bytes.Split(body, []byte("\n")) {
		rest, ok := bytes.CutPrefix(line, []byte(lastConfigInfo+"{"))
		if !ok {
			continue
		}
		_, after, ok := bytes.Cut(rest, []byte(`hash="`))
		// apiserver_id_hash="..." also ends in hash=": only a label that starts the
		// label set or follows a comma is the config hash.
		for ok {
			start := len(rest) - len(after) - len(`hash="`)
			if start == 0 || rest[start-1] == ',' {
				break
			}
			_, after, ok = bytes.Cut(after, []byte(`hash="`))
		}
		if !ok {
			continue
		}
		if v, _, ok := bytes.Cut(after, []byte(`"`)); ok {
			out = append(out, string(v))
		}
	}
	return out
}

// tailBuffer keeps the last lines of a command's output for an error.
type tailBuffer struct {
	mu    sync.Mutex
	lines []string
}

func (t *tailBuffer) add(l string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.lines = append(t.lines, l)
	if len(t.lines) > 40 {
		t.lines = t.lines[1:]
	}
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.Join(t.lines, "\n")
}
