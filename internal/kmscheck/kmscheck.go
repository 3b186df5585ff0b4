// Package kmscheck checks a KMS v2 plugin against the contract kube-apiserver relies on,
// through the same gRPC client rekey's KMS v2 provider uses: a healthy Status with a
// key id, Status and Encrypt agreeing on it, a key id that stays put and is never
// reused, old key ids that still decrypt after a rotation, annotations and key ids
// within kube-apiserver's limits, deadlines, and latency. Real plugins break each of
// these in documented ways (a key id that flaps on every restart, a fixed key id that
// hides rotation, decrypting only with the current key version), and each breaks an
// apiserver differently, so every check is reported on its own.
//
// Key ids appear in reports only as "sha256:<hex>" (state.KeyIDHash); no key material is
// ever printed.
package kmscheck

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"math"
	"net"
	"sort"
	"strings"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers/kmsdial"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/client"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/wire"
)

// Verdict is the outcome of one check.
type Verdict string

// The verdicts. Only Fail makes a report fail: Warn is a behaviour an apiserver copes
// with but an operator should know about, NotChecked a check that could not run here.
const (
	Pass       Verdict = "pass"
	Fail       Verdict = "fail"
	Warn       Verdict = "warn"
	NotChecked Verdict = "not-checked"
)

// Names of the checks, in the order of a report.
const (
	CheckReachable      = "reachable"
	CheckStatus         = "status"
	CheckKeyIDAgreement = "key-id-agreement"
	CheckKeyIDStable    = "key-id-stable"
	CheckRoundTrip      = "round-trip"
	CheckOldKeyIDs      = "old-key-ids-decrypt"
	CheckKeyIDReuse     = "key-id-reuse"
	CheckAnnotations    = "annotations"
	CheckKeyIDLength    = "key-id-length"
	CheckDeadline       = "deadline"
	CheckLatencyEncrypt = "latency-encrypt"
	CheckLatencyDecrypt = "latency-decrypt"
	CheckStartupFlap    = "startup-flap"
	CheckRestartKeyID   = "restart-key-id"
)

// Check is one named check of a report.
type Check struct {
	Name    string  `json:"name"`
	Verdict Verdict `json:"verdict"`
	// Detail is one line: what was seen, key ids as hashes.
	Detail string `json:"detail"`
	// Figures are measurements (counts, sizes, milliseconds), named with their unit.
	Figures map[string]float64 `json:"figures,omitempty"`
}

// Report is the outcome of Run.
type Report struct {
	Endpoint string  `json:"endpoint"`
	Checks   []Check `json:"checks"`
	// KeyIDHashes are the key ids seen, in the order first seen, as "sha256:<hex>".
	KeyIDHashes []string `json:"keyIDHashes"`
}

// Failed reports whether any check failed.
func (r *Report) Failed() bool {
	for _, c := range r.Checks {
		if c.Verdict == Fail {
			return true
		}
	}
	return false
}

// Check returns the check called name, or nil.
func (r *Report) Check(name string) *Check {
	for i := range r.Checks {
		if r.Checks[i].Name == name {
			return &r.Checks[i]
		}
	}
	return nil
}

// Defaults of Options.
const (
	DefaultCalls         = 20
	DefaultObserve       = 10 * time.Second
	DefaultSamples       = 10
	DefaultShortDeadline = 100 * time.Millisecond
)

// Options configure Run. Zero values take the defaults.
type Options struct {
	// Endpoint is the plugin's unix:///path.sock (or unix:///@abstract).
	Endpoint string
	// Calls is the number of Encrypt and Decrypt calls measured for latency, each with
	// a Status beside it for the key id agreement.
	Calls int
	// Observe is the observation window over which the key id is sampled Samples times
	// (with an Encrypt each time, kept to decrypt at the end).
	Observe time.Duration
	Samples int
	// Timeout bounds each call, as the provider's `timeout` does in an apiserver.
	Timeout time.Duration
	// ShortDeadline is the deadline of the deadline check's call.
	ShortDeadline time.Duration
	// OneVersionPerProcess names the plugin as one that decrypts only with its current
	// key version: old key ids that no longer decrypt are a warning, not a failure.
	OneVersionPerProcess bool
	// Restart, when set, restarts the plugin and returns once it listens again; the
	// restart checks run only with it.
	Restart func(ctx context.Context) error
	// Sleep waits between observation samples (the i-th wait is i, from 1); tests
	// replace it to run fast and to act on the plugin at a known point.
	Sleep func(ctx context.Context, i int, d time.Duration) error
	// Now is the clock latencies are measured with.
	Now func() time.Time
}

func (o *Options) defaults() {
	if o.Calls <= 0 {
		o.Calls = DefaultCalls
	}
	if o.Observe <= 0 {
		o.Observe = DefaultObserve
	}
	if o.Samples <= 0 {
		o.Samples = DefaultSamples
	}
	if o.Timeout <= 0 {
		o.Timeout = config.DefaultKMSTimeout
	}
	if o.ShortDeadline <= 0 {
		o.ShortDeadline = DefaultShortDeadline
	}
	if o.Sleep == nil {
		o.Sleep = sleep
	}
	if o.Now == nil {
		o.Now = time.Now
	}
}

func sleep(ctx context.Context, _ int, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// sealed is one Encrypt answer kept to be decrypted later.
type sealed struct {
	keyID       string
	plaintext   []byte
	ciphertext  []byte
	annotations map[string][]byte
}

// checker holds what one Run has seen.
type checker struct {
	o      Options
	c      *client.Client
	report Report
	// ids are every key id seen, to hash them in plugin error text.
	ids map[string]bool
	// writes are the Encrypt key ids in call order.
	writes []sealed
	// agreement counts Status/Encrypt pairs compared and the ones that disagreed.
	compared, disagreed int
	disagreeExample     string
	encLat, decLat      []time.Duration
	encErrs, decErrs    int
	roundTrips          int
	roundTripErr        string
	// statusIDs are the key ids of the observation's Status calls, in order.
	statusIDs []string
	// reuse is the first key id seen to return after another one, with whether its
	// first ciphertext still decrypted when it did.
	reuse         string
	reuseDecrypts bool
	reuseErr      string
	maxAnnoBytes  int
	annoErr       string
}

// Run checks the plugin at o.Endpoint. The error is only for a check that cannot start
// (a malformed endpoint); whatever the plugin does is in the report.
func Run(ctx context.Context, o Options) (*Report, error) {
	o.defaults()
	addr, err := kmsdial.ParseEndpoint(o.Endpoint)
	if err != nil {
		return nil, err
	}
	k := &checker{o: o, ids: map[string]bool{}, report: Report{Endpoint: o.Endpoint}}
	// The client waits for a connection until each call's deadline, so a socket
	// nobody listens on would look like a slow plugin; one plain dial tells them apart.
	d := net.Dialer{Timeout: o.Timeout}
	conn, err := d.DialContext(ctx, "unix", addr)
	if err != nil {
		k.add(CheckReachable, Fail, fmt.Sprintf("cannot connect to %s: %v; start the plugin or fix the endpoint", o.Endpoint, err), nil)
		k.notChecked(CheckStatus, "the plugin is not reachable")
		return &k.report, nil
	}
	_ = conn.Close()
	k.c, err = client.New(o.Endpoint, o.Timeout, nil)
	if err != nil {
		return nil, err
	}
	defer k.c.Close()
	k.add(CheckReachable, Pass, "the socket accepts connections", nil)

	if !k.checkStatus(ctx) {
		k.notChecked(CheckKeyIDAgreement, "Status is not healthy")
		return &k.report, nil
	}
	k.measure(ctx)
	k.observe(ctx)
	k.checkAgreement()
	k.checkStable()
	k.checkRoundTrip()
	k.checkOldKeyIDs(ctx)
	k.checkReuse()
	k.checkAnnotations()
	k.checkKeyIDLength()
	k.checkDeadline(ctx)
	k.checkLatency(CheckLatencyEncrypt, k.encLat, k.encErrs)
	k.checkLatency(CheckLatencyDecrypt, k.decLat, k.decErrs)
	k.checkRestart(ctx)
	// Calls cut short by a cancellation look like a broken plugin; a report made of
	// them would blame it for the interruption.
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("kms-check was interrupted before its checks finished (%w); run it again to the end for a report", err)
	}
	return &k.report, nil
}

func (k *checker) add(name string, v Verdict, detail string, figures map[string]float64) {
	k.report.Checks = append(k.report.Checks, Check{Name: name, Verdict: v, Detail: detail, Figures: figures})
}

// notChecked reports every check from name on (in report order) as not checked.
func (k *checker) notChecked(from, reason string) {
	all := []string{CheckReachable, CheckStatus, CheckKeyIDAgreement, CheckKeyIDStable, CheckRoundTrip, CheckOldKeyIDs, CheckKeyIDReuse, CheckAnnotations, CheckKeyIDLength, CheckDeadline, CheckLatencyEncrypt, CheckLatencyDecrypt, CheckStartupFlap, CheckRestartKeyID}
	on := false
	for _, n := range all {
		on = on || n == from
		if on {
			k.add(n, NotChecked, reason, nil)
		}
	}
}

// seen records a key id and returns its hash.
func (k *checker) seen(id string) string {
	if id != "" && !k.ids[id] {
		k.ids[id] = true
		k.report.KeyIDHashes = append(k.report.KeyIDHashes, state.KeyIDHash(id))
	}
	return hash(id)
}

func hash(id string) string {
	if id == "" {
		return `""`
	}
	return state.KeyIDHash(id)
}

// errText is a plugin error without the key ids it may quote: gRPC code and message,
// every key id seen replaced by its hash.
func (k *checker) errText(err error) string {
	msg := err.Error()
	if s, ok := status.FromError(err); ok {
		msg = s.Code().String() + ": " + s.Message()
	}
	ids := make([]string, 0, len(k.ids))
	for id := range k.ids {
		ids = append(ids, id)
	}
	// Longest first, so that an id containing another is replaced whole.
	sort.Slice(ids, func(i, j int) bool { return len(ids[i]) > len(ids[j]) })
	for _, id := range ids {
		msg = strings.ReplaceAll(msg, id, state.KeyIDHash(id))
	}
	return msg
}

func (k *checker) checkStatus(ctx context.Context) bool {
	st, err := k.c.Status(ctx)
	switch {
	case err != nil:
		k.add(CheckStatus, Fail, "Status failed: "+k.errText(err)+"; fix the plugin until Status answers", nil)
	case st.Healthz != "ok":
		k.add(CheckStatus, Fail, fmt.Sprintf("Status healthz is %q, want \"ok\"; an apiserver reports this plugin unhealthy", clip(st.Healthz)), nil)
	case st.KeyID == "":
		k.add(CheckStatus, Fail, "Status answered no key id; an apiserver cannot write without one", nil)
	case st.Version != state.VersionV2 && st.Version != state.VersionV2beta1:
		k.add(CheckStatus, Fail, fmt.Sprintf("Status version is %q, want %q", clip(st.Version), state.VersionV2), nil)
	default:
		k.add(CheckStatus, Pass, fmt.Sprintf("healthz ok, version %s, key id %s", st.Version, k.seen(st.KeyID)), nil)
		return true
	}
	k.seen(st.KeyID)
	return false
}

// clip bounds text a plugin answered before it goes into a one-line detail.
func clip(s string) string {
	const max = 64
	if len(s) > max {
		return s[:max] + "…"
	}
	return s
}

// statusID is the key id of one Status call, "" when it failed.
func (k *checker) statusID(ctx context.Context) string {
	st, err := k.c.Status(ctx)
	if err != nil {
		return ""
	}
	k.seen(st.KeyID)
	return st.KeyID
}

// encrypt seals a random DEK seed-sized plaintext, compares the key id with the Status
// calls on either side (a rotation between them is no disagreement), and keeps the
// result. It returns the answer, or nil when Encrypt failed.
func (k *checker) encrypt(ctx context.Context) *sealed {
	before := k.statusID(ctx)
	pt := make([]byte, 32)
	_, _ = rand.Read(pt)
	start := k.o.Now()
	enc, err := k.c.Encrypt(ctx, uuid.NewString(), pt)
	k.encLat = append(k.encLat, k.o.Now().Sub(start))
	if err != nil {
		k.encErrs++
		if k.roundTripErr == "" {
			k.roundTripErr = "Encrypt failed: " + k.errText(err)
		}
		return nil
	}
	k.seen(enc.KeyID)
	after := k.statusID(ctx)
	if before != "" && before == after {
		k.compared++
		if enc.KeyID != before {
			k.disagreed++
			if k.disagreeExample == "" {
				k.disagreeExample = fmt.Sprintf("Status said %s, Encrypt %s", hash(before), hash(enc.KeyID))
			}
		}
	}
	s := sealed{keyID: enc.KeyID, plaintext: pt, ciphertext: enc.Ciphertext, annotations: enc.Annotations}
	k.noteAnnotations(enc.Annotations)
	k.writes = append(k.writes, s)
	return &s
}

// decrypt unwraps s and says what went wrong ("" when the plaintext came back).
func (k *checker) decrypt(ctx context.Context, s *sealed, measured bool) string {
	start := k.o.Now()
	pt, err := k.c.Decrypt(ctx, uuid.NewString(), s.keyID, s.ciphertext, s.annotations)
	if measured {
		k.decLat = append(k.decLat, k.o.Now().Sub(start))
	}
	switch {
	case err != nil:
		if measured {
			k.decErrs++
		}
		return "Decrypt failed: " + k.errText(err)
	case !bytes.Equal(pt, s.plaintext):
		return fmt.Sprintf("Decrypt returned %d bytes that differ from the %d encrypted", len(pt), len(s.plaintext))
	}
	return ""
}

// measure runs o.Calls Encrypt and Decrypt round trips back to back.
func (k *checker) measure(ctx context.Context) {
	for i := 0; i < k.o.Calls; i++ {
		s := k.encrypt(ctx)
		if s == nil {
			continue
		}
		k.roundTrips++
		if msg := k.decrypt(ctx, s, true); msg != "" && k.roundTripErr == "" {
			k.roundTripErr = msg
		}
	}
}

// observe samples Status and Encrypt o.Samples+1 times over o.Observe. When a key id
// comes back after another one, its first ciphertext is decrypted at once, while it is
// current again: that tells a return to the same key from a reuse of the id for
// another key even with a plugin that decrypts only with its current key.
func (k *checker) observe(ctx context.Context) {
	interval := k.o.Observe / time.Duration(k.o.Samples)
	for i := 0; i <= k.o.Samples; i++ {
		if i > 0 {
			if err := k.o.Sleep(ctx, i, interval); err != nil {
				return
			}
		}
		if id := k.statusID(ctx); id != "" {
			k.statusIDs = append(k.statusIDs, id)
		}
		prev := len(k.writes)
		s := k.encrypt(ctx)
		if s == nil || k.reuse != "" {
			continue
		}
		if first := k.returned(k.writes[:prev], s.keyID); first != nil {
			k.reuse = s.keyID
			k.reuseErr = k.decrypt(ctx, first, false)
			k.reuseDecrypts = k.reuseErr == ""
		}
	}
}

// returned is the first write under id when id had been written with before another
// id was (A … B … A), else nil.
func (k *checker) returned(earlier []sealed, id string) *sealed {
	if len(earlier) == 0 || earlier[len(earlier)-1].keyID == id {
		return nil
	}
	for i := range earlier {
		if earlier[i].keyID == id {
			return &earlier[i]
		}
	}
	return nil
}

func (k *checker) checkAgreement() {
	figs := map[string]float64{"compared": float64(k.compared), "disagreed": float64(k.disagreed)}
	switch {
	case k.compared == 0:
		k.add(CheckKeyIDAgreement, NotChecked, "no Encrypt had a steady Status on both sides to compare with", figs)
	case k.disagreed > 0:
		k.add(CheckKeyIDAgreement, Fail, fmt.Sprintf("%d of %d Encrypt calls answered another key id than Status (%s): an apiserver sees a rotation on every write", k.disagreed, k.compared, k.disagreeExample), figs)
	default:
		k.add(CheckKeyIDAgreement, Pass, fmt.Sprintf("Status and Encrypt agreed on the key id in %d calls", k.compared), figs)
	}
}

// changes is the number of times the key id changed along ids.
func changes(ids []string) int {
	n := 0
	for i := 1; i < len(ids); i++ {
		if ids[i] != ids[i-1] {
			n++
		}
	}
	return n
}

func (k *checker) checkStable() {
	n := changes(k.statusIDs)
	figs := map[string]float64{"samples": float64(len(k.statusIDs)), "changes": float64(n), "window_seconds": k.o.Observe.Seconds()}
	switch {
	case len(k.statusIDs) == 0:
		k.add(CheckKeyIDStable, NotChecked, "no Status answered during the observation", figs)
	case n == 0:
		k.add(CheckKeyIDStable, Pass, fmt.Sprintf("key id %s over %s (a plugin that reports a fixed key id also passes: its rotation cannot be seen)", hash(k.statusIDs[0]), k.o.Observe), figs)
	default:
		k.add(CheckKeyIDStable, Warn, fmt.Sprintf("the key id changed %d times in %s, last to %s: a rotation, or a plugin whose key id flaps (each change makes apiservers write with a new DEK)", n, k.o.Observe, hash(k.statusIDs[len(k.statusIDs)-1])), figs)
	}
}

func (k *checker) checkRoundTrip() {
	figs := map[string]float64{"calls": float64(k.roundTrips)}
	switch {
	case k.roundTripErr != "":
		k.add(CheckRoundTrip, Fail, k.roundTripErr+"; an apiserver could not write or read with this plugin", figs)
	case k.roundTrips == 0:
		k.add(CheckRoundTrip, NotChecked, "no Encrypt answered", figs)
	default:
		k.add(CheckRoundTrip, Pass, fmt.Sprintf("%d Encrypt/Decrypt round trips returned the plaintext", k.roundTrips), figs)
	}
}

// checkOldKeyIDs decrypts the first ciphertext of every key id Encrypt answered other
// than the last one: an apiserver reads data written before a rotation with its old key id.
func (k *checker) checkOldKeyIDs(ctx context.Context) {
	if len(k.writes) == 0 {
		k.add(CheckOldKeyIDs, NotChecked, "no Encrypt answered", nil)
		return
	}
	current := k.writes[len(k.writes)-1].keyID
	var firsts []*sealed
	done := map[string]bool{current: true}
	for i := range k.writes {
		if w := &k.writes[i]; !done[w.keyID] {
			done[w.keyID] = true
			firsts = append(firsts, w)
		}
	}
	if len(firsts) == 0 {
		k.add(CheckOldKeyIDs, NotChecked, "the key id did not change while observed, so there was no old key id to decrypt with (a plugin with a fixed key id never shows one); observe across a rotation", nil)
		return
	}
	failed := 0
	var example string
	for _, w := range firsts {
		if msg := k.decrypt(ctx, w, false); msg != "" {
			failed++
			if example == "" {
				example = fmt.Sprintf("%s: %s", hash(w.keyID), msg)
			}
		}
	}
	figs := map[string]float64{"old_key_ids": float64(len(firsts)), "failed": float64(failed)}
	switch {
	case failed == 0:
		k.add(CheckOldKeyIDs, Pass, fmt.Sprintf("ciphertext of %d earlier key ids still decrypts", len(firsts)), figs)
	case k.o.OneVersionPerProcess:
		k.add(CheckOldKeyIDs, Warn, fmt.Sprintf("%d of %d earlier key ids no longer decrypt (%s); named one version per process: keep a plugin process per old key version until rekey migrate has rewritten its data", failed, len(firsts), example), figs)
	default:
		k.add(CheckOldKeyIDs, Fail, fmt.Sprintf("%d of %d earlier key ids no longer decrypt (%s): data written before a rotation becomes unreadable", failed, len(firsts), example), figs)
	}
}

func (k *checker) checkReuse() {
	switch {
	case k.reuse == "":
		k.add(CheckKeyIDReuse, Pass, "no key id came back after another one", nil)
	case !k.reuseDecrypts:
		k.add(CheckKeyIDReuse, Fail, fmt.Sprintf("key id %s came back after another one and its earlier ciphertext no longer decrypts (%s): the id was reused for other key material, which the KMS v2 contract forbids", hash(k.reuse), k.reuseErr), nil)
	default:
		k.add(CheckKeyIDReuse, Warn, fmt.Sprintf("key id %s came back after another one (A → B → A) with the same key material: a rollback, or a plugin that flaps between keys; apiservers treat every change as a rotation", hash(k.reuse)), nil)
	}
}

func (k *checker) noteAnnotations(annos map[string][]byte) {
	if len(annos) == 0 {
		return
	}
	list := make([]wire.Annotation, 0, len(annos))
	total := 0
	for key, v := range annos {
		list = append(list, wire.Annotation{Key: []byte(key), Value: v})
		total += len(key) + len(v)
	}
	k.maxAnnoBytes = max(k.maxAnnoBytes, total)
	if err := wire.ValidateAnnotations(list); err != nil && k.annoErr == "" {
		k.annoErr = strings.ReplaceAll(err.Error(), "\n", "; ")
	}
}

func (k *checker) checkAnnotations() {
	figs := map[string]float64{"max_total_bytes": float64(k.maxAnnoBytes), "limit_bytes": wire.AnnotationsMaxSize}
	switch {
	case k.annoErr != "":
		k.add(CheckAnnotations, Fail, k.annoErr+": kube-apiserver refuses to store such a value", figs)
	case k.maxAnnoBytes == 0:
		k.add(CheckAnnotations, Pass, "Encrypt returned no annotations", figs)
	default:
		k.add(CheckAnnotations, Pass, fmt.Sprintf("annotation keys are fully-qualified domain names, at most %d of %d bytes in all", k.maxAnnoBytes, wire.AnnotationsMaxSize), figs)
	}
}

func (k *checker) checkKeyIDLength() {
	longest := 0
	var bad string
	for id := range k.ids {
		longest = max(longest, len(id))
		if _, err := wire.ValidateKeyID(id); err != nil && bad == "" {
			bad = fmt.Sprintf("key id %s: %v", hash(id), err)
		}
	}
	figs := map[string]float64{"max_bytes": float64(longest), "limit_bytes": wire.KeyIDMaxSize}
	if bad != "" {
		k.add(CheckKeyIDLength, Fail, bad+": kube-apiserver refuses to write with it", figs)
		return
	}
	k.add(CheckKeyIDLength, Pass, fmt.Sprintf("every key id is valid UTF-8 of at most %d of %d bytes", longest, wire.KeyIDMaxSize), figs)
}

// deadlineGrace is how much later than its deadline a call may return: scheduling on
// a busy machine, not the plugin.
func (k *checker) deadlineGrace() time.Duration { return k.o.ShortDeadline/2 + 50*time.Millisecond }

// checkDeadline makes one Status call with a short deadline, then a normal one: the
// first must return by its deadline, answered or not, and a call the client gave up
// on must not keep the plugin from answering the next.
func (k *checker) checkDeadline(ctx context.Context) {
	short, cancel := context.WithTimeout(ctx, k.o.ShortDeadline)
	start := k.o.Now()
	_, err := k.c.Status(short)
	took := k.o.Now().Sub(start)
	cancel()
	figs := map[string]float64{"deadline_ms": ms(k.o.ShortDeadline), "returned_after_ms": ms(took)}
	if took > k.o.ShortDeadline+k.deadlineGrace() {
		k.add(CheckDeadline, Fail, fmt.Sprintf("a Status with a %s deadline returned after %s: calls outlive their deadline", k.o.ShortDeadline, took.Round(time.Millisecond)), figs)
		return
	}
	if _, err := k.c.Status(ctx); err != nil {
		k.add(CheckDeadline, Fail, "after a call with a short deadline, the next Status failed: "+k.errText(err), figs)
		return
	}
	if status.Code(err) == codes.DeadlineExceeded || errors.Is(err, context.DeadlineExceeded) {
		k.add(CheckDeadline, Warn, fmt.Sprintf("Status did not answer within %s; the call ended in time and the plugin answered the next one", k.o.ShortDeadline), figs)
		return
	}
	if err != nil {
		k.add(CheckDeadline, Fail, "Status with a short deadline failed: "+k.errText(err), figs)
		return
	}
	k.add(CheckDeadline, Pass, fmt.Sprintf("Status with a %s deadline answered after %s", k.o.ShortDeadline, took.Round(time.Microsecond)), figs)
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// percentile of sorted durations, nearest rank.
func percentile(sorted []time.Duration, p float64) time.Duration {
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[max(i, 0)]
}

// checkLatency warns when p99 is above half the timeout: that leaves an apiserver little
// room before its calls time out under load.
func (k *checker) checkLatency(name string, lat []time.Duration, errs int) {
	if len(lat) == 0 {
		k.add(name, NotChecked, "no calls were made", nil)
		return
	}
	s := append([]time.Duration(nil), lat...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	p50, p99 := percentile(s, 0.50), percentile(s, 0.99)
	figs := map[string]float64{"calls": float64(len(s)), "errors": float64(errs), "p50_ms": ms(p50), "p99_ms": ms(p99), "timeout_ms": ms(k.o.Timeout)}
	detail := fmt.Sprintf("p50 %s, p99 %s over %d calls (%d failed)", p50.Round(time.Microsecond), p99.Round(time.Microsecond), len(s), errs)
	if p99 > k.o.Timeout/2 {
		k.add(name, Warn, detail+fmt.Sprintf("; p99 is above half the %s timeout", k.o.Timeout), figs)
		return
	}
	k.add(name, Pass, detail, figs)
}

// settleCalls is how many Status calls after a restart decide which key id the plugin
// settled on.
const settleCalls = 3

// firstStatusID is the key id of the first Status the plugin answers after a restart.
// The first calls may fail on the connection the restart broke (the client notices it
// only then); an apiserver retries those too, so they are not the plugin's answer.
func (k *checker) firstStatusID(ctx context.Context) string {
	deadline := k.o.Now().Add(k.o.Timeout)
	for {
		if id := k.statusID(ctx); id != "" || k.o.Now().After(deadline) {
			return id
		}
		if err := sleep(ctx, 0, restartRetry); err != nil {
			return ""
		}
	}
}

// restartRetry is the pause between Status calls while a restarted plugin comes up.
const restartRetry = 20 * time.Millisecond

// checkRestart restarts the plugin through o.Restart: the first Status after the start
// must report the key id the later ones and Encrypt report (GCP's plugin reports a key
// URI first, and every apiserver then sees a rotation per plugin restart), the key id
// should survive the restart, and data written before it must still decrypt.
func (k *checker) checkRestart(ctx context.Context) {
	if k.o.Restart == nil {
		const why = "needs a restart of the plugin: give kms-check the command that starts it (--plugin-command)"
		k.add(CheckStartupFlap, NotChecked, why, nil)
		k.add(CheckRestartKeyID, NotChecked, why, nil)
		return
	}
	var before string
	if len(k.statusIDs) > 0 {
		before = k.statusIDs[len(k.statusIDs)-1]
	}
	var old *sealed
	if len(k.writes) > 0 {
		old = &k.writes[len(k.writes)-1]
	}
	if err := k.o.Restart(ctx); err != nil {
		why := "the restart failed: " + err.Error()
		k.add(CheckStartupFlap, NotChecked, why, nil)
		k.add(CheckRestartKeyID, Fail, why, nil)
		return
	}
	first := k.firstStatusID(ctx)
	var settled string
	for i := 0; i < settleCalls; i++ {
		settled = k.statusID(ctx)
	}
	s := k.encrypt(ctx)
	switch {
	case first == "" || settled == "" || s == nil:
		k.add(CheckStartupFlap, Fail, "after the restart, Status or Encrypt failed; the plugin must answer as soon as it listens", nil)
	case first != settled || s.keyID != settled:
		k.add(CheckStartupFlap, Fail, fmt.Sprintf("the first Status after a restart reported %s, later Status %s and Encrypt %s: every plugin restart looks like a key rotation to the apiservers", hash(first), hash(settled), hash(s.keyID)), nil)
	default:
		k.add(CheckStartupFlap, Pass, fmt.Sprintf("the first Status after a restart reported %s, as later Status and Encrypt did", hash(first)), nil)
	}
	var oldErr string
	if old != nil {
		oldErr = k.decrypt(ctx, old, false)
	}
	switch {
	case oldErr != "":
		k.add(CheckRestartKeyID, Fail, "ciphertext written before the restart no longer decrypts ("+oldErr+")", nil)
	case settled == "":
		k.add(CheckRestartKeyID, Fail, "Status failed after the restart", nil)
	case before != "" && settled != before:
		k.add(CheckRestartKeyID, Warn, fmt.Sprintf("the key id changed across the restart (%s → %s): a rotation at start-up; apiservers re-key their writes after every restart", hash(before), hash(settled)), nil)
	default:
		k.add(CheckRestartKeyID, Pass, fmt.Sprintf("key id %s before and after the restart; earlier ciphertext still decrypts", hash(settled)), nil)
	}
}
