package kmsv1

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"encoding/binary"
	"errors"
	"fmt"

	"k8s.io/apiserver/pkg/apis/apiserver"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/utils/lru"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers/internal/aescbc"
)

// Prefix starts every KMS v1 value; the provider name and ':' follow.
const Prefix = "k8s:enc:kms:v1:"

// DefaultCacheSize is the number of DEKs kept when the configuration sets no
// `cachesize` (upstream's default).
const DefaultCacheSize = 1000

// Sizes of the stored form.
const (
	// dekLengthSize is the big-endian uint16 that precedes the encrypted DEK.
	dekLengthSize = 2
	gcmNonceSize  = 12
)

// ErrReadOnly is the error of every write: KMS v1 is only ever read.
var ErrReadOnly = errors.New(config.KMSv1ReadOnlyError)

// ErrUndecryptable is the error of every value whose data (after a DEK the plugin
// unwrapped) decrypts neither as AES-GCM nor as AES-CBC: one error, whatever failed.
var ErrUndecryptable = errors.New("the data decrypts neither as AES-GCM nor as AES-CBC under its DEK")

// Decrypter unwraps the encrypted DEK of a value: a KMS v1 plugin (Client).
type Decrypter interface {
	Decrypt(ctx context.Context, encryptedDEK []byte) ([]byte, error)
}

// Provider reads one KMS v1 provider's values. It implements the Sealer shape of
// pkg/transformers (Prefix, Seal, Open); Seal always fails.
type Provider struct {
	name   string
	prefix []byte
	plugin Decrypter
	// deks maps an encrypted DEK (as a string) to its *dek; nil when caching is off.
	deks  *lru.Cache
	close func() error
}

// dek is an unwrapped DEK, ready for both data ciphers a v1 value may use.
type dek struct {
	gcm cipher.AEAD
	cbc *aescbc.Cipher
}

// New connects (lazily) to the plugin of cfg, a `kms` entry with apiVersion v1.
func New(cfg *apiserver.KMSConfiguration) (*Provider, error) {
	c, err := Dial(cfg.Endpoint, config.KMSTimeout(cfg))
	if err != nil {
		return nil, fmt.Errorf("kms v1 provider %q: %w", cfg.Name, err)
	}
	size := DefaultCacheSize
	if cfg.CacheSize != nil {
		size = int(*cfg.CacheSize)
	}
	p := NewWithDecrypter(cfg.Name, size, c)
	p.close = c.Close
	return p, nil
}

// NewWithDecrypter is a Provider named name whose DEKs d unwraps, caching up to
// cacheSize of them (none when cacheSize <= 0).
func NewWithDecrypter(name string, cacheSize int, d Decrypter) *Provider {
	p := &Provider{name: name, prefix: []byte(Prefix + name + ":"), plugin: d}
	if cacheSize > 0 {
		p.deks = lru.New(cacheSize)
	}
	return p
}

// Name is the provider name from the configuration.
func (p *Provider) Name() string { return p.name }

// Prefix is "k8s:enc:kms:v1:<name>:".
func (p *Provider) Prefix() []byte { return p.prefix }

// Seal refuses: rekey never writes KMS v1 values.
func (p *Provider) Seal(context.Context, []byte, value.Context) ([]byte, error) {
	return nil, fmt.Errorf("kms v1 provider %q: %w", p.name, ErrReadOnly)
}

// Open decrypts data, the bytes after the prefix, as upstream's v1 envelope
// transformer does. stale is true for a value whose data is AES-CBC (written before
// Kubernetes 1.25), as upstream reports it.
func (p *Provider) Open(ctx context.Context, data []byte, dataCtx value.Context) ([]byte, bool, error) {
	if len(data) < dekLengthSize {
		return nil, false, fmt.Errorf("kms v1 provider %q: the value is %d bytes, too short for the 2-byte length of its encrypted DEK (corrupted value)", p.name, len(data))
	}
	n := int(binary.BigEndian.Uint16(data))
	rest := data[dekLengthSize:]
	if n == 0 || n > len(rest) {
		return nil, false, fmt.Errorf("kms v1 provider %q: the value says its encrypted DEK is %d bytes, but %d bytes follow the length (corrupted value)", p.name, n, len(rest))
	}
	encryptedDEK, sealed := rest[:n], rest[n:]
	k, err := p.dek(ctx, encryptedDEK)
	if err != nil {
		return nil, false, err
	}
	// Kubernetes 1.25 and later write AES-GCM; 1.24 and earlier wrote AES-CBC. The
	// value does not say which, so GCM is tried first, as upstream does.
	if len(sealed) >= gcmNonceSize {
		if out, err := k.gcm.Open(nil, sealed[:gcmNonceSize], sealed[gcmNonceSize:], dataCtx.AuthenticatedData()); err == nil {
			return out, false, nil
		}
	}
	// One error whatever failed (see aescbc.ErrOpen: no padding oracle).
	out, err := k.cbc.Open(sealed)
	if err != nil {
		return nil, false, fmt.Errorf("kms v1 provider %q: %w: a corrupted value, or one moved to another etcd key", p.name, ErrUndecryptable)
	}
	return out, true, nil
}

// dek returns the unwrapped DEK of encryptedDEK, from the cache or the plugin.
func (p *Provider) dek(ctx context.Context, encryptedDEK []byte) (*dek, error) {
	if p.deks != nil {
		if k, ok := p.deks.Get(string(encryptedDEK)); ok {
			return k.(*dek), nil
		}
	}
	key, err := p.plugin.Decrypt(ctx, encryptedDEK)
	if err != nil {
		// %w keeps the gRPC status: migration retries Unavailable and DeadlineExceeded.
		return nil, fmt.Errorf("kms v1 provider %q: the plugin could not decrypt the value's DEK: %w", p.name, err)
	}
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, fmt.Errorf("kms v1 provider %q: the plugin returned a %d-byte DEK; AES needs 16, 24 or 32 bytes", p.name, len(key))
	}
	gcm, err := cipher.NewGCM(block)
	if err != nil {
		return nil, fmt.Errorf("kms v1 provider %q: %w", p.name, err)
	}
	cbc, err := aescbc.New(key)
	if err != nil {
		return nil, fmt.Errorf("kms v1 provider %q: %w", p.name, err)
	}
	k := &dek{gcm: gcm, cbc: cbc}
	if p.deks != nil {
		p.deks.Add(string(encryptedDEK), k)
	}
	return k, nil
}

// Close closes the plugin connection of a Provider made by New.
func (p *Provider) Close() {
	if p.close != nil {
		_ = p.close()
	}
}
