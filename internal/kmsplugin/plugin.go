// Package kmsplugin is a local KMS v2 (or, with Options.APIVersion, KMS v1) plugin for tests, the testbed and benchmarks. It
// serves k8s.io/kms/pkg/service over a unix socket, wraps DEK sources with AES-256-GCM
// key-encryption keys read from a keys file (rotated by editing the file), and exposes a
// control endpoint that injects faults at run time.
//
//	srv, err := kmsplugin.Start(kmsplugin.Options{ListenAddr: "unix://" + privateDir + "/kms.sock", KeysFile: "keys.yaml"})
//	defer srv.Stop()
//	srv.SetFaults(kmsplugin.Faults{StatusHealthz: "down"})
package kmsplugin

import (
	"bytes"
	"context"
	"crypto/aes"
	"crypto/cipher"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	kmsv1api "k8s.io/kms/apis/v1beta1"
	kmsapi "k8s.io/kms/apis/v2"
	"k8s.io/kms/pkg/service"
	"sigs.k8s.io/yaml"

	"github.com/rekey-io/rekey/pkg/config"
)

// KeysFile is the keys file format (YAML or JSON). The first key is active: its name is
// the key_id of Status and Encrypt. Every key can Decrypt.
type KeysFile struct {
	Keys []Key `json:"keys"`
}

// Key is one key-encryption key.
type Key struct {
	Name string `json:"name"`
	// Secret is the base64 of 32 random bytes.
	Secret string `json:"secret"`
}

// Faults change the plugin's answers at run time. The zero value is a healthy plugin.
type Faults struct {
	// Latency is added to every RPC.
	Latency Duration `json:"latency,omitempty"`
	// Fail* make the RPC fail with gRPC code Unavailable (or FailCode, e.g. "DeadlineExceeded").
	FailStatus  bool   `json:"failStatus,omitempty"`
	FailEncrypt bool   `json:"failEncrypt,omitempty"`
	FailDecrypt bool   `json:"failDecrypt,omitempty"`
	FailCode    string `json:"failCode,omitempty"`
	// StatusHealthz replaces "ok" in Status.
	StatusHealthz string `json:"statusHealthz,omitempty"`
	// StatusVersion replaces "v2" in Status.
	StatusVersion string `json:"statusVersion,omitempty"`
	// StatusKeyID and EncryptKeyID replace the active key id in Status / Encrypt answers.
	StatusKeyID  string `json:"statusKeyID,omitempty"`
	EncryptKeyID string `json:"encryptKeyID,omitempty"`
	// StatusNoKeyID makes Status report an empty key id (a plugin that lost its key).
	StatusNoKeyID bool `json:"statusNoKeyID,omitempty"`
	// DecryptWrongPlaintext makes Decrypt succeed with other bytes than were encrypted
	// (a plugin that unwraps with the wrong key without noticing).
	DecryptWrongPlaintext bool `json:"decryptWrongPlaintext,omitempty"`
	// Annotations are returned by Encrypt.
	Annotations map[string]string `json:"annotations,omitempty"`

	// The faults below emulate documented behaviours of real KMS v2 plugins, so that
	// rekey kms-check (and tests) can be shown each of them.

	// StartupFlap makes the first Status after the plugin started report the key id in a
	// key URI form (StartupKeyURIPrefix + id) and every later Status and Encrypt the
	// plain id: the key id changes once on every restart, as GCP's plugin does. Set it
	// before the first Status (Options.Faults) or it shows after the next restart.
	StartupFlap bool `json:"startupFlap,omitempty"`
	// DecryptActiveOnly makes Decrypt refuse ciphertext whose key id is not the one
	// Status currently reports ("one version per process", as Azure's plugin and
	// upstream's mock do): data written before a rotation no longer decrypts.
	DecryptActiveOnly bool `json:"decryptActiveOnly,omitempty"`
	// FixedKeyID is reported by Status and Encrypt whatever key is active (as AWS's
	// plugin reports one key ARN): a rotation of the keys file cannot be seen from the
	// key id. Decrypt accepts it and finds the key that sealed the ciphertext.
	FixedKeyID string `json:"fixedKeyID,omitempty"`
	// ActiveKey makes this key of the keys file the active one instead of the first,
	// so that a rotation, and a return to an earlier key id (A → B → A), needs no file
	// edit. A key id reused with other material is a keys file whose key keeps its name
	// and gets a new secret.
	ActiveKey string `json:"activeKey,omitempty"`
}

// StartupKeyURIPrefix is what StartupFlap puts before the key id in the first Status.
const StartupKeyURIPrefix = "kms://local-plugin/keys/"

// Duration is a time.Duration that reads and writes as "150ms" in JSON.
type Duration struct{ time.Duration }

// MarshalJSON implements json.Marshaler.
func (d Duration) MarshalJSON() ([]byte, error) { return []byte(`"` + d.String() + `"`), nil }

// UnmarshalJSON implements json.Unmarshaler.
func (d *Duration) UnmarshalJSON(b []byte) error {
	s := strings.Trim(string(b), `"`)
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("latency %q: %w (use Go duration syntax, e.g. 150ms)", s, err)
	}
	d.Duration = v
	return nil
}

// Stats count calls per method.
type Stats struct {
	Status  int64 `json:"status"`
	Encrypt int64 `json:"encrypt"`
	Decrypt int64 `json:"decrypt"`
}

// Options configure a plugin.
type Options struct {
	// ListenAddr is unix:///path.sock or unix:///@abstract; empty means
	// DefaultListenAddr. A socket file's directory must be private (see checkSocketDir).
	ListenAddr string
	// KeysFile is the path of the keys file, re-read whenever it changes.
	KeysFile string
	// ControlAddr, when set, serves the control API: unix:///path.sock or host:port
	// (loopback only).
	ControlAddr string
	// APIVersion is the KMS API served: "" or "v2" for KMS v2, APIVersionV1 for KMS v1.
	APIVersion string
	// Faults are active from the start: a fault about the first calls after a start
	// (StartupFlap) must be set before any client can call.
	Faults Faults
}

type keyring struct {
	active string
	aeads  map[string]cipher.AEAD
}

// Plugin is the KMS v2 service (k8s.io/kms/pkg/service.Service).
type Plugin struct {
	keysFile string

	mu      sync.Mutex
	stamp   fileStamp
	raw     []byte
	ring    *keyring
	loadErr error

	faults atomic.Pointer[Faults]
	stats  struct{ status, encrypt, decrypt atomic.Int64 }
}

var _ service.Service = (*Plugin)(nil)

type fileStamp struct {
	mod  time.Time
	size int64
	ino  any
}

// NewPlugin loads the keys file.
func NewPlugin(keysFile string) (*Plugin, error) {
	p := &Plugin{keysFile: keysFile}
	p.faults.Store(&Faults{})
	if _, err := p.keys(); err != nil {
		return nil, err
	}
	return p, nil
}

// keys returns the keyring, re-reading the file when its size or mtime changed. A file
// that becomes invalid keeps the last good keyring and is reported by Status.
func (p *Plugin) keys() (*keyring, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	fi, err := os.Stat(p.keysFile)
	if err != nil {
		if p.ring != nil {
			p.loadErr = err
			return p.ring, nil
		}
		return nil, fmt.Errorf("keys file: %w", err)
	}
	st := fileStamp{mod: fi.ModTime(), size: fi.Size(), ino: fi.Sys()}
	if p.ring != nil && st.mod.Equal(p.stamp.mod) && st.size == p.stamp.size {
		return p.ring, nil
	}
	raw, err := os.ReadFile(p.keysFile)
	if err != nil {
		return p.fallback(err)
	}
	p.stamp = st
	if p.ring != nil && bytes.Equal(raw, p.raw) {
		return p.ring, nil
	}
	ring, err := parseKeys(raw)
	if err != nil {
		return p.fallback(fmt.Errorf("keys file %s: %w", p.keysFile, err))
	}
	p.raw, p.ring, p.loadErr = raw, ring, nil
	return ring, nil
}

func (p *Plugin) fallback(err error) (*keyring, error) {
	if p.ring == nil {
		return nil, err
	}
	p.loadErr = err
	return p.ring, nil
}

func parseKeys(raw []byte) (*keyring, error) {
	var f KeysFile
	if err := yaml.UnmarshalStrict(raw, &f); err != nil {
		// The parser's messages can quote the file, secrets included.
		return nil, fmt.Errorf("not a keys file (want `keys: [{name: ..., secret: <base64 of 32 bytes>}]`): %s", config.DescribeDecodeError(err, "keys file"))
	}
	if len(f.Keys) == 0 {
		return nil, errors.New("no keys; the first key is the active one")
	}
	r := &keyring{active: f.Keys[0].Name, aeads: map[string]cipher.AEAD{}}
	for i, k := range f.Keys {
		if k.Name == "" {
			return nil, fmt.Errorf("keys[%d] has no name", i)
		}
		if _, dup := r.aeads[k.Name]; dup {
			return nil, fmt.Errorf("keys[%d]: name %q is used twice", i, k.Name)
		}
		secret, err := base64.StdEncoding.DecodeString(k.Secret)
		if err != nil || len(secret) != 32 {
			return nil, fmt.Errorf("keys[%d] (%q): secret must be the base64 of 32 bytes", i, k.Name)
		}
		b, _ := aes.NewCipher(secret)
		// The module draws the nonce and prepends it (nonce(12) ‖ GCM), the layout this
		// plugin always wrote; GCM with nonces the caller draws (cipher.NewGCM) is
		// refused under GODEBUG=fips140=only, this one is approved there.
		a, err := cipher.NewGCMWithRandomNonce(b)
		if err != nil {
			return nil, fmt.Errorf("keys[%d] (%q): %w", i, k.Name, err)
		}
		r.aeads[k.Name] = a
	}
	return r, nil
}

// SetFaults replaces the active faults.
func (p *Plugin) SetFaults(f Faults) { p.faults.Store(&f) }

// Faults returns the active faults.
func (p *Plugin) Faults() Faults { return *p.faults.Load() }

// Stats returns call counts.
func (p *Plugin) Stats() Stats {
	return Stats{Status: p.stats.status.Load(), Encrypt: p.stats.encrypt.Load(), Decrypt: p.stats.decrypt.Load()}
}

func (p *Plugin) inject(ctx context.Context, fail bool, method string) (*Faults, error) {
	f := p.faults.Load()
	if f.Latency.Duration > 0 {
		t := time.NewTimer(f.Latency.Duration)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return f, status.FromContextError(ctx.Err()).Err()
		}
	}
	if fail {
		code := codes.Unavailable
		for c := codes.OK; c <= codes.Unauthenticated; c++ {
			if f.FailCode != "" && c.String() == f.FailCode {
				code = c
			}
		}
		return f, status.Errorf(code, "kms-plugin: %s fails (injected fault)", method)
	}
	return f, nil
}

// Status implements service.Service.
func (p *Plugin) Status(ctx context.Context) (*service.StatusResponse, error) {
	first := p.stats.status.Add(1) == 1
	f, err := p.inject(ctx, p.faults.Load().FailStatus, "Status")
	if err != nil {
		return nil, err
	}
	ring, err := p.keys()
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "kms-plugin: %v", err)
	}
	active, err := activeKey(ring, f)
	if err != nil {
		return nil, err
	}
	r := &service.StatusResponse{Version: "v2", Healthz: "ok", KeyID: reportedKeyID(active, f)}
	if first && f.StartupFlap {
		r.KeyID = StartupKeyURIPrefix + r.KeyID
	}
	if f.StatusHealthz != "" {
		r.Healthz = f.StatusHealthz
	}
	if f.StatusVersion != "" {
		r.Version = f.StatusVersion
	}
	if f.StatusKeyID != "" {
		r.KeyID = f.StatusKeyID
	}
	if f.StatusNoKeyID {
		r.KeyID = ""
	}
	return r, nil
}

// Encrypt implements service.Service: nonce(12) ‖ AES-256-GCM(plaintext), the key id as
// authenticated data.
func (p *Plugin) Encrypt(ctx context.Context, _ string, plaintext []byte) (*service.EncryptResponse, error) {
	p.stats.encrypt.Add(1)
	f, err := p.inject(ctx, p.faults.Load().FailEncrypt, "Encrypt")
	if err != nil {
		return nil, err
	}
	ring, err := p.keys()
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "kms-plugin: %v", err)
	}
	active, err := activeKey(ring, f)
	if err != nil {
		return nil, err
	}
	a := ring.aeads[active]
	// The key's own name is the authenticated data even under FixedKeyID: Decrypt
	// finds the key that sealed the ciphertext by it. Seal draws the nonce and
	// writes nonce(12) ‖ ciphertext ‖ tag.
	r := &service.EncryptResponse{Ciphertext: a.Seal(make([]byte, 0, 12+len(plaintext)+16), nil, plaintext, []byte(active)), KeyID: reportedKeyID(active, f)}
	if f.EncryptKeyID != "" {
		r.KeyID = f.EncryptKeyID
	}
	if len(f.Annotations) > 0 {
		r.Annotations = map[string][]byte{}
		for k, v := range f.Annotations {
			r.Annotations[k] = []byte(v)
		}
	}
	return r, nil
}

// Decrypt implements service.Service.
func (p *Plugin) Decrypt(ctx context.Context, _ string, req *service.DecryptRequest) ([]byte, error) {
	p.stats.decrypt.Add(1)
	f, err := p.inject(ctx, p.faults.Load().FailDecrypt, "Decrypt")
	if err != nil {
		return nil, err
	}
	ring, err := p.keys()
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "kms-plugin: %v", err)
	}
	if f.DecryptActiveOnly {
		active, err := activeKey(ring, f)
		if err != nil {
			return nil, err
		}
		if current := reportedKeyID(active, f); req.KeyID != current {
			return nil, status.Errorf(codes.FailedPrecondition, "kms-plugin: key id %q is not the current key id; this plugin decrypts only with its current key (injected fault)", req.KeyID)
		}
	}
	if len(req.Ciphertext) < 12+16 {
		return nil, status.Error(codes.InvalidArgument, "kms-plugin: ciphertext is too short")
	}
	var pt []byte
	if f.FixedKeyID != "" && req.KeyID == f.FixedKeyID {
		pt, err = openWithAnyKey(ring, req.Ciphertext)
	} else {
		pt, err = openWithKey(ring, req.KeyID, req.Ciphertext)
	}
	if err != nil {
		return nil, err
	}
	if f.DecryptWrongPlaintext && len(pt) > 0 {
		pt[0] ^= 0xff
	}
	return pt, nil
}

// activeKey is the name of the key Encrypt uses: Faults.ActiveKey, or the keys file's first.
func activeKey(ring *keyring, f *Faults) (string, error) {
	if f.ActiveKey == "" {
		return ring.active, nil
	}
	if _, ok := ring.aeads[f.ActiveKey]; !ok {
		return "", status.Errorf(codes.FailedPrecondition, "kms-plugin: active key %q (fault activeKey) is not in the keys file; add it or clear the fault", f.ActiveKey)
	}
	return f.ActiveKey, nil
}

// reportedKeyID is the key id Status and Encrypt answer for the active key.
func reportedKeyID(active string, f *Faults) string {
	if f.FixedKeyID != "" {
		return f.FixedKeyID
	}
	return active
}

func openWithKey(ring *keyring, keyID string, ciphertext []byte) ([]byte, error) {
	a, ok := ring.aeads[keyID]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "kms-plugin: unknown key id %q; it is not in the keys file", keyID)
	}
	pt, err := a.Open(nil, nil, ciphertext, []byte(keyID))
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "kms-plugin: ciphertext does not decrypt under key %q", keyID)
	}
	return pt, nil
}

// openWithAnyKey opens ciphertext of a FixedKeyID plugin: the key id says nothing about
// the key, and GCM authentication (the key's name is the authenticated data) tells
// the one that sealed it.
func openWithAnyKey(ring *keyring, ciphertext []byte) ([]byte, error) {
	for name, a := range ring.aeads {
		if pt, err := a.Open(nil, nil, ciphertext, []byte(name)); err == nil {
			return pt, nil
		}
	}
	return nil, status.Error(codes.InvalidArgument, "kms-plugin: ciphertext does not decrypt under any key of the keys file")
}

// Server is a running plugin: gRPC on ListenAddr and, optionally, the control API.
type Server struct {
	*Plugin
	grpc    *grpc.Server
	lis     net.Listener
	control *controlServer
	addr    string
	done    chan struct{}
}

// Start listens and serves in the background; the socket accepts connections when it
// returns.
func Start(o Options) (*Server, error) {
	addr, err := CheckListenAddr(o.ListenAddr)
	if err != nil {
		return nil, err
	}
	p, err := NewPlugin(o.KeysFile)
	if err != nil {
		return nil, err
	}
	p.SetFaults(o.Faults)
	lis, err := ListenUnix(addr)
	if err != nil {
		return nil, err
	}
	gs := grpc.NewServer()
	switch o.APIVersion {
	case "", "v2":
		kmsapi.RegisterKeyManagementServiceServer(gs, service.NewGRPCService(addr, 0, p))
	case APIVersionV1:
		kmsv1api.RegisterKeyManagementServiceServer(gs, v1Service{p: p})
	default:
		_ = lis.Close()
		return nil, fmt.Errorf("kms-plugin: API version %q is not served; use v2 (default) or v1", o.APIVersion)
	}
	s := &Server{Plugin: p, grpc: gs, lis: lis, addr: addr, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		_ = gs.Serve(lis)
	}()
	if o.ControlAddr != "" {
		c, err := startControl(o.ControlAddr, p)
		if err != nil {
			s.Stop()
			return nil, err
		}
		s.control = c
	}
	return s, nil
}

// ControlAddr is the address the control API listens on ("" when disabled).
func (s *Server) ControlAddr() string {
	if s.control == nil {
		return ""
	}
	return s.control.addr
}

// Stop closes every connection at once (a plugin crash, as far as clients can tell).
func (s *Server) Stop() {
	s.grpc.Stop()
	<-s.done
	if s.control != nil {
		s.control.close()
	}
	if !strings.HasPrefix(s.addr, "@") {
		_ = os.Remove(s.addr)
	}
}

// Run serves until ctx ends.
func Run(ctx context.Context, o Options) error {
	s, err := Start(o)
	if err != nil {
		return err
	}
	<-ctx.Done()
	s.grpc.GracefulStop()
	s.Stop()
	return nil
}

func socketPath(endpoint string) (string, error) {
	rest, ok := strings.CutPrefix(endpoint, "unix://")
	if !ok || rest == "" || rest == "/" {
		return "", fmt.Errorf("kms-plugin: listen address %q must be unix:///path.sock or unix:///@abstract-name", endpoint)
	}
	if strings.HasPrefix(rest, "/@") {
		return rest[1:], nil
	}
	return rest, nil
}
