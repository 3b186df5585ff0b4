// Package server is the KMS v2 service (k8s.io/kms/pkg/service.Service) over the key
// versions of one key label on a PKCS#11 token (package token): Encrypt seals with the
// current version, Decrypt opens with the version its request's key id names (every
// version still on the token, in one process), Status reports the current version's
// key id and the cached result of a periodic seal/open probe.
//
// A driver calls Step(now) on every tick (Run does it with a ticker): Step logs in
// when not logged in — at most once per LoginRetryInterval, however often Status,
// Encrypt or Decrypt are called, so a wrong PIN never turns into a storm of login
// attempts that locks the token — re-reads the current version every RefreshInterval,
// and probes every ProbeInterval. Status re-reads the current version too: a rotate
// run by the CLI shows in the next Status.
package server

import (
	"context"
	"crypto/cipher"
	"crypto/rand"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/kms/pkg/service"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
	"github.com/rekey-io/rekey/plugins/kms-pkcs11/internal/token"
)

// Defaults of Options.
const (
	DefaultLoginRetryInterval = time.Minute
	DefaultProbeInterval      = 30 * time.Second
	DefaultRefreshInterval    = 10 * time.Second
)

// nonceSize is AES-GCM's standard nonce; a ciphertext is nonce ‖ sealed.
const nonceSize = 12

// probeSize is the plaintext of one health probe: one seal and one open of 32 bytes
// per ProbeInterval is the probe's whole cost on the token.
const probeSize = 32

// Opener opens the token: one call is one login attempt.
type Opener func() (*token.Token, error)

// Options configure a Service.
type Options struct {
	// Open logs in and opens the key label.
	Open Opener
	// KeyLabel is the key label (for messages and key ids).
	KeyLabel string
	// LoginRetryInterval is the least time between two login attempts.
	LoginRetryInterval time.Duration
	// ProbeInterval is how often a seal/open probe runs.
	ProbeInterval time.Duration
	// RefreshInterval is how often the versions on the token are read again (a
	// version retired by the CLI stops decrypting within it).
	RefreshInterval time.Duration
	Clock           clock.PassiveClock
	Logger          logr.Logger
	// Registry receives the metrics; nil records none.
	Registry prometheus.Registerer
}

// Service is the KMS v2 service. Its methods are safe for concurrent use.
type Service struct {
	o Options
	m *metrics

	stepMu       sync.Mutex // one Step at a time
	mu           sync.Mutex
	tok          *token.Token
	lastLogin    time.Time // zero: never attempted
	loginErr     error
	current      token.Version
	currentErr   error
	lastRefresh  time.Time
	lastProbe    time.Time
	probeErr     error
	probed       bool
	aeads        map[uint64]cipher.AEAD
	retiredKnown map[uint64]bool
	closed       bool
}

var _ service.Service = (*Service)(nil)

// New makes a Service; it logs in on the first Step.
func New(o Options) (*Service, error) {
	if o.Open == nil || o.KeyLabel == "" {
		return nil, errors.New("server: Open and KeyLabel are required")
	}
	if o.LoginRetryInterval <= 0 {
		o.LoginRetryInterval = DefaultLoginRetryInterval
	}
	if o.ProbeInterval <= 0 {
		o.ProbeInterval = DefaultProbeInterval
	}
	if o.RefreshInterval <= 0 {
		o.RefreshInterval = DefaultRefreshInterval
	}
	if o.Clock == nil {
		o.Clock = clock.RealClock{}
	}
	m, err := newMetrics(o.Registry)
	if err != nil {
		return nil, err
	}
	return &Service{o: o, m: m, aeads: map[uint64]cipher.AEAD{}, retiredKnown: map[uint64]bool{}}, nil
}

// Tick is how often Run calls Step: often enough for the shortest interval.
func (s *Service) Tick() time.Duration {
	return max(min(s.o.LoginRetryInterval, s.o.ProbeInterval, s.o.RefreshInterval)/2, 100*time.Millisecond)
}

// Run calls Step at once and then every Tick until ctx ends.
func (s *Service) Run(ctx context.Context, c clock.WithTicker) {
	s.Step(c.Now())
	t := c.NewTicker(s.Tick())
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C():
			s.Step(now)
		}
	}
}

// Step does what is due at now: a login attempt when not logged in and none was made
// within LoginRetryInterval, else a refresh of the versions and a probe when due. The
// login runs outside the service's lock, so a slow token does not hold Status up.
func (s *Service) Step(now time.Time) {
	s.stepMu.Lock()
	defer s.stepMu.Unlock()
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	if s.tok == nil {
		if !s.lastLogin.IsZero() && now.Sub(s.lastLogin) < s.o.LoginRetryInterval {
			s.mu.Unlock()
			return
		}
		s.lastLogin = now
		s.mu.Unlock()
		tok, err := s.o.Open()
		s.mu.Lock()
		defer s.mu.Unlock()
		if err != nil {
			s.loginErr = err
			s.m.logins.WithLabelValues("failed").Inc()
			s.m.healthy.Set(0)
			s.o.Logger.Error(err, "PKCS#11 login failed; next attempt after --login-retry-interval", "retryAt", now.Add(s.o.LoginRetryInterval).UTC().Format(time.RFC3339))
			return
		}
		s.m.logins.WithLabelValues("ok").Inc()
		if s.closed {
			tok.Close()
			return
		}
		s.tok, s.loginErr = tok, nil
		s.aeads = map[uint64]cipher.AEAD{}
		s.o.Logger.Info("PKCS#11 token open", "keyLabel", s.o.KeyLabel)
		s.refreshLocked(now)
		if s.tok != nil {
			s.probeLocked(now)
		}
		return
	}
	defer s.mu.Unlock()
	if now.Sub(s.lastRefresh) >= s.o.RefreshInterval {
		s.refreshLocked(now)
	}
	if s.tok != nil && now.Sub(s.lastProbe) >= s.o.ProbeInterval {
		s.probeLocked(now)
	}
}

// AdminSessionsInUse is how many of the token's state sessions are open (0 between
// calls, or when not logged in).
func (s *Service) AdminSessionsInUse() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.tok == nil {
		return 0
	}
	return s.tok.AdminSessionsInUse()
}

// refreshLocked reads the versions: the current one, and which are retired or gone
// (their cached AEADs are dropped).
func (s *Service) refreshLocked(now time.Time) {
	s.lastRefresh = now
	vs, err := s.tok.Versions()
	if err != nil {
		s.currentErr = err
		s.lostLocked(err)
		return
	}
	onToken := map[uint64]bool{}
	s.currentErr = fmt.Errorf("pkcs11: key label %q: %w; run the rotate command once to create version 1", s.o.KeyLabel, token.ErrNoVersion)
	for _, v := range vs {
		onToken[v.Number] = true
		s.retiredKnown[v.Number] = v.State == token.Retired
		if v.State == token.Current {
			s.setCurrentLocked(v)
		}
	}
	for n := range s.aeads {
		if !onToken[n] || s.retiredKnown[n] {
			delete(s.aeads, n)
		}
	}
}

func (s *Service) setCurrentLocked(v token.Version) {
	if v.Number != s.current.Number {
		s.o.Logger.Info("current key version", "version", v.Number, "keyIDHash", state.KeyIDHash(v.KeyID))
	}
	s.current, s.currentErr = v, nil
	s.m.current.Set(float64(v.Number))
}

// probeLocked seals and opens probeSize random bytes with the current version.
func (s *Service) probeLocked(now time.Time) {
	s.lastProbe, s.probed = now, true
	err := s.currentErr
	if err == nil {
		err = s.roundTripLocked(s.current)
	}
	if err != nil && s.probeErr == nil {
		s.o.Logger.Error(err, "PKCS#11 health probe failed")
	}
	s.probeErr = err
	if err != nil {
		s.m.healthy.Set(0)
		s.lostLocked(err)
		return
	}
	s.m.healthy.Set(1)
}

func (s *Service) roundTripLocked(v token.Version) error {
	a, err := s.aeadLocked(v.Number)
	if err != nil {
		return err
	}
	pt := make([]byte, probeSize)
	if _, err := rand.Read(pt); err != nil {
		return err
	}
	ct, err := seal(a, pt, v.KeyID)
	if err != nil {
		return fmt.Errorf("probe seal with version %d (%s): %w", v.Number, state.KeyIDHash(v.KeyID), err)
	}
	got, err := open(a, ct, v.KeyID)
	if err != nil {
		return fmt.Errorf("probe open with version %d (%s): %w", v.Number, state.KeyIDHash(v.KeyID), err)
	}
	if string(got) != string(pt) {
		return fmt.Errorf("probe with version %d (%s): the token opened other bytes than it sealed", v.Number, state.KeyIDHash(v.KeyID))
	}
	return nil
}

// lostLocked closes the token after an error that says the login or the session is
// gone, so that the next Step logs in again (at the login rate).
func (s *Service) lostLocked(err error) {
	if !lostLogin(err) {
		return
	}
	s.o.Logger.Error(err, "PKCS#11 login or session lost; logging in again at the next attempt")
	s.tok.Close()
	s.tok, s.loginErr = nil, err
	s.aeads = map[uint64]cipher.AEAD{}
}

func lostLogin(err error) bool {
	for _, rv := range []string{"CKR_USER_NOT_LOGGED_IN", "CKR_SESSION_HANDLE_INVALID", "CKR_SESSION_CLOSED", "CKR_DEVICE_REMOVED", "CKR_TOKEN_NOT_PRESENT", "CKR_CRYPTOKI_NOT_INITIALIZED", "CKR_DEVICE_ERROR"} {
		if strings.Contains(err.Error(), rv) {
			return true
		}
	}
	return false
}

func (s *Service) aeadLocked(n uint64) (cipher.AEAD, error) {
	if a, ok := s.aeads[n]; ok {
		return a, nil
	}
	a, err := s.tok.AEAD(n)
	if err != nil {
		return nil, err
	}
	s.aeads[n] = a
	return a, nil
}

func seal(a cipher.AEAD, pt []byte, keyID string) ([]byte, error) {
	out := make([]byte, nonceSize, nonceSize+len(pt)+a.Overhead())
	if _, err := rand.Read(out); err != nil {
		return nil, err
	}
	return a.Seal(out, out[:nonceSize], pt, []byte(keyID)), nil
}

func open(a cipher.AEAD, ct []byte, keyID string) ([]byte, error) {
	if len(ct) < nonceSize+a.Overhead() {
		return nil, fmt.Errorf("ciphertext of %d bytes is shorter than a nonce and a tag", len(ct))
	}
	return a.Open(nil, ct[:nonceSize], ct[nonceSize:], []byte(keyID))
}

// notLoggedInLocked is the error of a call while not logged in.
func (s *Service) notLoggedInLocked() error {
	if s.lastLogin.IsZero() {
		return errors.New("pkcs11: not logged in yet")
	}
	return fmt.Errorf("pkcs11: not logged in: %v; next login attempt at %s (one per --login-retry-interval %s)",
		s.loginErr, s.lastLogin.Add(s.o.LoginRetryInterval).UTC().Format(time.RFC3339), s.o.LoginRetryInterval)
}

// Status implements service.Service: the current version's key id (read again from
// the token) and "ok", or the cause of being unhealthy. It never logs in.
func (s *Service) Status(ctx context.Context) (*service.StatusResponse, error) {
	start := s.o.Clock.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	r := &service.StatusResponse{Version: "v2", Healthz: "ok"}
	switch {
	case s.tok == nil:
		r.Healthz = s.notLoggedInLocked().Error()
	default:
		cur, err := s.tok.Current()
		if err != nil {
			s.currentErr = err
			s.lostLocked(err)
			r.Healthz = err.Error()
			break
		}
		s.setCurrentLocked(cur)
		if s.probed && s.probeErr != nil {
			r.Healthz = fmt.Sprintf("pkcs11: the health probe at %s failed: %v", s.lastProbe.UTC().Format(time.RFC3339), s.probeErr)
		}
	}
	r.KeyID = s.current.KeyID
	s.m.observe("Status", r.Healthz == "ok", s.o.Clock.Since(start))
	return r, nil
}

// Encrypt implements service.Service: nonce ‖ AES-256-GCM on the token with the current
// version, the key id as authenticated data.
func (s *Service) Encrypt(ctx context.Context, _ string, plaintext []byte) (*service.EncryptResponse, error) {
	start := s.o.Clock.Now()
	resp, err := s.encrypt(plaintext)
	s.m.observe("Encrypt", err == nil, s.o.Clock.Since(start))
	return resp, err
}

func (s *Service) encrypt(plaintext []byte) (*service.EncryptResponse, error) {
	s.mu.Lock()
	if s.tok == nil {
		err := s.notLoggedInLocked()
		s.mu.Unlock()
		return nil, status.Error(codes.Unavailable, err.Error())
	}
	if s.currentErr != nil {
		err := s.currentErr
		s.mu.Unlock()
		return nil, status.Error(codes.FailedPrecondition, err.Error())
	}
	cur := s.current
	a, err := s.aeadLocked(cur.Number)
	s.mu.Unlock()
	if err != nil {
		return nil, status.Error(codes.Unavailable, err.Error())
	}
	ct, err := seal(a, plaintext, cur.KeyID)
	if err != nil {
		return nil, status.Errorf(codes.Unavailable, "pkcs11: sealing with version %d (%s): %v", cur.Number, state.KeyIDHash(cur.KeyID), err)
	}
	return &service.EncryptResponse{Ciphertext: ct, KeyID: cur.KeyID}, nil
}

// Decrypt implements service.Service with the version the request's key id names.
func (s *Service) Decrypt(ctx context.Context, _ string, req *service.DecryptRequest) ([]byte, error) {
	start := s.o.Clock.Now()
	pt, err := s.decrypt(req)
	s.m.observe("Decrypt", err == nil, s.o.Clock.Since(start))
	return pt, err
}

func (s *Service) decrypt(req *service.DecryptRequest) ([]byte, error) {
	n, err := token.ParseKeyID(s.o.KeyLabel, req.KeyID)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, "pkcs11: "+err.Error())
	}
	s.mu.Lock()
	if s.tok == nil {
		err := s.notLoggedInLocked()
		s.mu.Unlock()
		return nil, status.Error(codes.Unavailable, err.Error())
	}
	if s.retiredKnown[n] {
		s.mu.Unlock()
		return nil, status.Errorf(codes.FailedPrecondition, "pkcs11: version %d (key id %s) is retired: it no longer decrypts", n, state.KeyIDHash(req.KeyID))
	}
	a, err := s.aeadLocked(n)
	s.mu.Unlock()
	switch {
	case errors.Is(err, token.ErrRetired):
		return nil, status.Errorf(codes.FailedPrecondition, "pkcs11: version %d (key id %s) is retired: it no longer decrypts", n, state.KeyIDHash(req.KeyID))
	case errors.Is(err, token.ErrNotFound):
		return nil, status.Errorf(codes.NotFound, "pkcs11: version %d (key id %s) is not on the token (destroyed?)", n, state.KeyIDHash(req.KeyID))
	case err != nil:
		return nil, status.Error(codes.Unavailable, err.Error())
	}
	pt, err := open(a, req.Ciphertext, req.KeyID)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "pkcs11: opening with version %d (key id %s): %v", n, state.KeyIDHash(req.KeyID), err)
	}
	return pt, nil
}

// Close logs out and closes the token; later calls fail as not logged in.
func (s *Service) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	if s.tok != nil {
		s.tok.Close()
		s.tok = nil
	}
}
