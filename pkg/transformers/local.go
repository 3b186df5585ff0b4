package transformers

import (
	"bytes"
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"

	"golang.org/x/crypto/nacl/secretbox"
	"k8s.io/apiserver/pkg/apis/apiserver"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/transformers/internal/aescbc"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv1"
)

// KMSv1APIVersion is the `apiVersion` of a KMS v1 provider in the configuration.
const KMSv1APIVersion = "v1"

// Stored prefixes of the local providers, as kube-apiserver writes them.
const (
	AESGCMPrefix    = "k8s:enc:aesgcm:v1:"
	AESCBCPrefix    = "k8s:enc:aescbc:v1:"
	SecretboxPrefix = "k8s:enc:secretbox:v1:"
	KMSv2Prefix     = "k8s:enc:kms:v2:"
	// KMSv1Prefix is only ever read: rekey never writes KMS v1 values.
	KMSv1Prefix = kmsv1.Prefix
	// EncryptedMarker starts every encrypted value; identity refuses to read such data.
	EncryptedMarker = "k8s:enc:"
)

const (
	gcmNonceSize       = 12
	gcmTagSize         = 16
	cbcIVSize          = aes.BlockSize
	secretboxNonceSize = 24
	secretboxKeySize   = 32
)

var (
	// errShortData is upstream's words for a value too short for its nonce and tag.
	errShortData         = errors.New("the stored data was shorter than the required size")
	errIdentityEncrypted = errors.New("identity transformer tried to read encrypted data")
)

// keyPrefix is the full stored prefix of one key: provider prefix ‖ key name ‖ ':'.
func keyPrefix(providerPrefix, keyName string) []byte {
	return []byte(KeyPrefix(providerPrefix, keyName))
}

func decodeKey(k apiserver.Key, provider string) ([]byte, error) {
	if k.Name == "" {
		return nil, fmt.Errorf("%s: a key has an empty name", provider)
	}
	secret, err := base64.StdEncoding.DecodeString(k.Secret)
	if err != nil {
		// Never echo the secret or the decoder's view of it.
		return nil, fmt.Errorf("%s key %q: secret is not valid base64", provider, k.Name)
	}
	return secret, nil
}

// sealWithPrefix allocates the one output buffer of a write: prefix ‖ room for
// extra bytes. It returns the buffer with len = len(prefix).
func sealWithPrefix(prefix []byte, capacity int) []byte {
	out := make([]byte, len(prefix), capacity)
	copy(out, prefix)
	return out
}

// checked is a Sealer of a local key: it knows its key's check value (CheckValue).
type checked interface{ checkValue() string }

func (g *gcmSealer) checkValue() string { return g.check }
func (c *cbcSealer) checkValue() string { return c.check }
func (b *boxSealer) checkValue() string { return b.check }

// ---- identity ----

// identitySealer stores plaintext and refuses to read values that carry an encryption
// prefix, so a later provider gets to read them.
type identitySealer struct{}

func (identitySealer) Prefix() []byte { return nil }

// Seal returns the input itself, as upstream's identity transformer does; the storage
// layer does not modify the slice.
func (identitySealer) Seal(_ context.Context, plaintext []byte, _ value.Context) ([]byte, error) {
	return plaintext, nil
}

func (identitySealer) Open(_ context.Context, data []byte, _ value.Context) ([]byte, bool, error) {
	if bytes.HasPrefix(data, []byte(EncryptedMarker)) {
		return nil, false, errIdentityEncrypted
	}
	return data, false, nil
}

// ---- aesgcm ----

// gcmSealer is AES-GCM with a random 96-bit nonce per write, the etcd key as AAD:
// prefix ‖ nonce(12) ‖ ciphertext ‖ tag(16).
type gcmSealer struct {
	prefix []byte
	check  string
	aead   cipher.AEAD
}

func newAESGCMSealers(keys []apiserver.Key) ([]Sealer, error) {
	if len(keys) == 0 {
		return nil, errors.New("aesgcm provider has no keys")
	}
	out := make([]Sealer, 0, len(keys))
	for _, k := range keys {
		secret, err := decodeKey(k, "aesgcm")
		if err != nil {
			return nil, err
		}
		block, err := aes.NewCipher(secret)
		if err != nil {
			return nil, fmt.Errorf("aesgcm key %q: key must be 16, 24 or 32 bytes, got %d", k.Name, len(secret))
		}
		// The AEAD draws each nonce itself and writes it before the ciphertext, which
		// is upstream's layout (nonce(12) ‖ ciphertext ‖ tag(16)); it is the form of
		// AES-GCM that Go's FIPS 140-3 module allows under GODEBUG=fips140=only
		// (cipher.NewGCM, with nonces the caller supplies, is refused there).
		aead, err := cipher.NewGCMWithRandomNonce(block)
		if err != nil {
			return nil, fmt.Errorf("aesgcm key %q: %w", k.Name, err)
		}
		out = append(out, &gcmSealer{prefix: keyPrefix(AESGCMPrefix, k.Name), check: CheckValue(AESGCMPrefix, secret), aead: aead})
	}
	return out, nil
}

func (g *gcmSealer) Prefix() []byte { return g.prefix }

func (g *gcmSealer) Seal(_ context.Context, plaintext []byte, dataCtx value.Context) ([]byte, error) {
	n := len(g.prefix)
	out := sealWithPrefix(g.prefix, n+gcmNonceSize+len(plaintext)+gcmTagSize)[:n]
	return g.aead.Seal(out, nil, plaintext, dataCtx.AuthenticatedData()), nil
}

func (g *gcmSealer) Open(_ context.Context, data []byte, dataCtx value.Context) ([]byte, bool, error) {
	if len(data) < gcmNonceSize+gcmTagSize {
		return nil, false, errShortData
	}
	out := make([]byte, 0, len(data)-gcmNonceSize-gcmTagSize)
	out, err := g.aead.Open(out, nil, data, dataCtx.AuthenticatedData())
	if err != nil {
		return nil, false, fmt.Errorf("aesgcm key %q: %w (wrong key, corrupted value, or value moved to another etcd key)", g.keyName(), err)
	}
	return out, false, nil
}

func (g *gcmSealer) keyName() string {
	_, k := describe(g)
	return k
}

// ---- aescbc ----

// cbcSealer is AES-CBC with a random IV and PKCS#7 padding, unauthenticated, exactly as
// upstream: prefix ‖ IV(16) ‖ ciphertext. It ignores the AAD.
type cbcSealer struct {
	prefix []byte
	check  string
	cbc    *aescbc.Cipher
}

func newAESCBCSealers(keys []apiserver.Key) ([]Sealer, error) {
	if len(keys) == 0 {
		return nil, errors.New("aescbc provider has no keys")
	}
	out := make([]Sealer, 0, len(keys))
	for _, k := range keys {
		secret, err := decodeKey(k, "aescbc")
		if err != nil {
			return nil, err
		}
		c, err := aescbc.New(secret)
		if err != nil {
			return nil, fmt.Errorf("aescbc key %q: %w", k.Name, err)
		}
		out = append(out, &cbcSealer{prefix: keyPrefix(AESCBCPrefix, k.Name), check: CheckValue(AESCBCPrefix, secret), cbc: c})
	}
	return out, nil
}

func (c *cbcSealer) Prefix() []byte { return c.prefix }

func (c *cbcSealer) Seal(_ context.Context, plaintext []byte, _ value.Context) ([]byte, error) {
	n := len(c.prefix)
	pad := aes.BlockSize - len(plaintext)%aes.BlockSize // always 1..16 bytes
	total := n + cbcIVSize + len(plaintext) + pad
	out := sealWithPrefix(c.prefix, total)[:total]
	iv := out[n : n+cbcIVSize]
	if _, err := rand.Read(iv); err != nil {
		return nil, fmt.Errorf("aescbc: reading a random IV: %w", err)
	}
	body := out[n+cbcIVSize:]
	copy(body, plaintext)
	for i := len(plaintext); i < len(body); i++ {
		body[i] = byte(pad)
	}
	c.cbc.Encrypt(iv, body, body)
	return out, nil
}

func (c *cbcSealer) Open(_ context.Context, data []byte, _ value.Context) ([]byte, bool, error) {
	out, err := c.cbc.Open(data)
	return out, false, err
}

// ---- secretbox ----

// boxSealer is NaCl secretbox (XSalsa20-Poly1305) with a random 24-byte nonce:
// prefix ‖ nonce(24) ‖ tag(16) ‖ ciphertext. Like upstream it does not bind the AAD.
type boxSealer struct {
	prefix []byte
	check  string
	key    [secretboxKeySize]byte
}

func newSecretboxSealers(keys []apiserver.Key) ([]Sealer, error) {
	if len(keys) == 0 {
		return nil, errors.New("secretbox provider has no keys")
	}
	out := make([]Sealer, 0, len(keys))
	for _, k := range keys {
		secret, err := decodeKey(k, "secretbox")
		if err != nil {
			return nil, err
		}
		if len(secret) != secretboxKeySize {
			return nil, fmt.Errorf("secretbox key %q: expected key size 32 for secretbox provider, got %d", k.Name, len(secret))
		}
		s := &boxSealer{prefix: keyPrefix(SecretboxPrefix, k.Name), check: CheckValue(SecretboxPrefix, secret)}
		copy(s.key[:], secret)
		out = append(out, s)
	}
	return out, nil
}

func (b *boxSealer) Prefix() []byte { return b.prefix }

func (b *boxSealer) Seal(_ context.Context, plaintext []byte, _ value.Context) ([]byte, error) {
	n := len(b.prefix)
	out := sealWithPrefix(b.prefix, n+secretboxNonceSize+secretbox.Overhead+len(plaintext))
	out = out[:n+secretboxNonceSize]
	nonce := (*[secretboxNonceSize]byte)(out[n:])
	if _, err := rand.Read(nonce[:]); err != nil {
		return nil, fmt.Errorf("secretbox: reading a random nonce: %w", err)
	}
	return secretbox.Seal(out, plaintext, nonce, &b.key), nil
}

func (b *boxSealer) Open(_ context.Context, data []byte, _ value.Context) ([]byte, bool, error) {
	if len(data) < secretboxNonceSize+secretbox.Overhead {
		return nil, false, errShortData
	}
	nonce := (*[secretboxNonceSize]byte)(data[:secretboxNonceSize])
	out := make([]byte, 0, len(data)-secretboxNonceSize-secretbox.Overhead)
	out, ok := secretbox.Open(out, data[secretboxNonceSize:], nonce, &b.key)
	if !ok {
		_, name := describe(b)
		return nil, false, fmt.Errorf("secretbox key %q: authentication failed (wrong key or corrupted value)", name)
	}
	return out, false, nil
}
