// Package token keeps the key versions of one key label on a PKCS#11 token: one
// AES-256 secret key object per version (CKA_LABEL the key label, CKA_ID the version as
// decimal text), generated on the token, sensitive and never extractable, and one data
// object (same label, CKA_APPLICATION StateApplication) holding the versions' state: the
// current version, the highest version ever issued (the high-water mark: a version
// number is never issued twice, even after the highest was destroyed), and each
// version's creation and retirement times.
//
//	tok, err := token.Open(token.Config{Module: "/usr/lib/softhsm/libsofthsm2.so", TokenLabel: "kms", PIN: pin, KeyLabel: "kek"})
//	defer tok.Close()
//	v, err := tok.Rotate(time.Now())      // a new version, current from now on
//	aead, err := tok.AEAD(v.Number)       // AES-256-GCM on the token (crypto11.SecretKey.NewGCM)
//
// Sealing goes through crypto11; the state object and the key attributes go through
// miekg/pkcs11 on the module crypto11 initialised. A retired version's key has
// CKA_ENCRYPT and CKA_DECRYPT set to false, so the token itself refuses it as well.
package token

import (
	"crypto/cipher"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThalesGroup/crypto11"
	"github.com/miekg/pkcs11"

	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
)

// StateApplication is the CKA_APPLICATION of the state data object.
const StateApplication = "rekey-kms-pkcs11"

// stateFormat is the format version of the state object's value.
const stateFormat = 1

// keyBits is the size of every key-encryption key.
const keyBits = 256

// Config says which token and key label to open.
type Config struct {
	// Module is the path of the PKCS#11 library.
	Module string
	// TokenLabel selects the token.
	TokenLabel string
	// PIN is the user PIN. It is never part of an error or log line.
	PIN string
	// KeyLabel is the CKA_LABEL of every version's key and of the state object.
	KeyLabel string
	// MaxSessions bounds the sessions crypto11's pool opens for sealing (at least 2;
	// one is held to keep the login). Zero means DefaultMaxSessions.
	MaxSessions int
	// SessionWait bounds how long a seal or open waits for a free session (zero:
	// DefaultSessionWait).
	SessionWait time.Duration
}

// DefaultMaxSessions and DefaultSessionWait are Config's defaults.
const (
	DefaultMaxSessions = 8
	DefaultSessionWait = 5 * time.Second
)

// State is a version's state as list shows it.
type State string

const (
	// Current: Encrypt seals with it.
	Current State = "current"
	// Active: it decrypts; it no longer seals.
	Active State = "active"
	// Retired: it no longer decrypts (the key's CKA_DECRYPT is false).
	Retired State = "retired"
)

// Version is one key version on the token.
type Version struct {
	Number  uint64
	KeyID   string
	Created time.Time
	// RetiredAt is when it was retired, or zero.
	RetiredAt time.Time
	State     State
}

// versionRecord is one version in the state object.
type versionRecord struct {
	Created time.Time  `json:"created"`
	Retired *time.Time `json:"retired,omitempty"`
}

// stateDoc is the state object's value. It holds version numbers and times only.
type stateDoc struct {
	Format int `json:"format"`
	// Seq counts the writes: of two state objects (a crash between writing the new
	// and removing the old) the higher counts.
	Seq      uint64                    `json:"seq"`
	Current  uint64                    `json:"current"`
	Highest  uint64                    `json:"highest"`
	Versions map[string]*versionRecord `json:"versions"`
}

// KeyID is the KMS key id of version n of label: "<label>:v<n>".
func KeyID(label string, n uint64) string { return label + ":v" + strconv.FormatUint(n, 10) }

// ParseKeyID returns the version a key id of label names.
func ParseKeyID(label, keyID string) (uint64, error) {
	rest, ok := strings.CutPrefix(keyID, label+":v")
	if !ok {
		return 0, fmt.Errorf("key id %s is not one of key label %q (want %s:v<N>)", state.KeyIDHash(keyID), label, label)
	}
	n, err := strconv.ParseUint(rest, 10, 64)
	if err != nil || n == 0 || strconv.FormatUint(n, 10) != rest {
		return 0, fmt.Errorf("key id %s does not end in a version number", state.KeyIDHash(keyID))
	}
	return n, nil
}

// Token is an open token and key label. Its methods are safe for concurrent use.
type Token struct {
	cfg  Config
	c11  *crypto11.Context
	p    *pkcs11.Ctx
	slot uint

	mu sync.Mutex // serialises state object updates within this process
	// admin bounds the sessions of state and attribute work (withSession): one slot
	// per session open. Sealing and opening use crypto11's pool (MaxSessions).
	admin chan struct{}
}

// adminSessions bounds the sessions withSession opens at once.
const adminSessions = 2

// ErrNoVersion: the label has no version yet (run rotate).
var ErrNoVersion = errors.New("the key label has no version yet")

// ErrRetired: the version is retired.
var ErrRetired = errors.New("the key version is retired")

// ErrNotFound: no key object of that version is on the token.
var ErrNotFound = errors.New("no key object of that version is on the token")

// Open logs in to the token (exactly one C_Login) and opens the key label.
func Open(cfg Config) (*Token, error) {
	if cfg.Module == "" || cfg.TokenLabel == "" || cfg.KeyLabel == "" {
		return nil, errors.New("pkcs11: the module path, the token label and the key label are required")
	}
	if cfg.MaxSessions == 0 {
		cfg.MaxSessions = DefaultMaxSessions
	}
	if cfg.MaxSessions < 2 {
		return nil, fmt.Errorf("pkcs11: --max-sessions %d is too small: one session keeps the login, so at least 2 are needed", cfg.MaxSessions)
	}
	if cfg.SessionWait == 0 {
		cfg.SessionWait = DefaultSessionWait
	}
	c11, err := crypto11.Configure(&crypto11.Config{
		Path:            cfg.Module,
		TokenLabel:      cfg.TokenLabel,
		Pin:             cfg.PIN,
		MaxSessions:     cfg.MaxSessions,
		PoolWaitTimeout: cfg.SessionWait,
	})
	if err != nil {
		return nil, fmt.Errorf("pkcs11: opening token %q with module %s: %s", cfg.TokenLabel, cfg.Module, describe(err))
	}
	t := &Token{cfg: cfg, c11: c11, admin: make(chan struct{}, adminSessions)}
	// The same library, initialised by crypto11: dlopen shares it, and C_Initialize
	// answers CKR_CRYPTOKI_ALREADY_INITIALIZED. The login is the application's, so
	// sessions opened here are logged in too.
	p := pkcs11.New(cfg.Module)
	if p == nil {
		_ = c11.Close()
		return nil, fmt.Errorf("pkcs11: cannot load module %s a second time", cfg.Module)
	}
	if err := p.Initialize(); err != nil && !errors.Is(err, pkcs11.Error(pkcs11.CKR_CRYPTOKI_ALREADY_INITIALIZED)) {
		p.Destroy()
		_ = c11.Close()
		return nil, fmt.Errorf("pkcs11: initialising module %s: %s", cfg.Module, describe(err))
	}
	t.p = p
	slot, err := t.findSlot()
	if err != nil {
		t.Close()
		return nil, err
	}
	t.slot = slot
	return t, nil
}

// Close ends every session and releases the module.
func (t *Token) Close() {
	if t.p != nil {
		// Never C_Finalize here: crypto11 owns the initialisation.
		t.p.Destroy()
		t.p = nil
	}
	if t.c11 != nil {
		_ = t.c11.Close()
		t.c11 = nil
	}
}

func (t *Token) findSlot() (uint, error) {
	slots, err := t.p.GetSlotList(true)
	if err != nil {
		return 0, fmt.Errorf("pkcs11: listing slots: %s", describe(err))
	}
	for _, s := range slots {
		ti, err := t.p.GetTokenInfo(s)
		if err == nil && strings.TrimRight(ti.Label, " ") == t.cfg.TokenLabel {
			return s, nil
		}
	}
	return 0, fmt.Errorf("pkcs11: no token labelled %q", t.cfg.TokenLabel)
}

// withSession runs f in a session of its own, closed before it returns.
// At most adminSessions are open at once; a caller waits up to SessionWait for one.
func (t *Token) withSession(f func(s pkcs11.SessionHandle) error) error {
	timer := time.NewTimer(t.cfg.SessionWait)
	defer timer.Stop()
	select {
	case t.admin <- struct{}{}:
	case <-timer.C:
		return fmt.Errorf("pkcs11: no free session within --session-wait %s (%d in use)", t.cfg.SessionWait, adminSessions)
	}
	defer func() { <-t.admin }()
	s, err := t.p.OpenSession(t.slot, pkcs11.CKF_SERIAL_SESSION|pkcs11.CKF_RW_SESSION)
	if err != nil {
		return fmt.Errorf("pkcs11: opening a session: %s", describe(err))
	}
	defer func() { _ = t.p.CloseSession(s) }()
	return f(s)
}

// AdminSessionsInUse is how many sessions of state and attribute work are open now
// (0 between calls: a test that sees more found a leak).
func (t *Token) AdminSessionsInUse() int { return len(t.admin) }

func (t *Token) find(s pkcs11.SessionHandle, tmpl []*pkcs11.Attribute) ([]pkcs11.ObjectHandle, error) {
	if err := t.p.FindObjectsInit(s, tmpl); err != nil {
		return nil, fmt.Errorf("pkcs11: searching objects: %s", describe(err))
	}
	var out []pkcs11.ObjectHandle
	for {
		hs, _, err := t.p.FindObjects(s, 64)
		if err != nil {
			_ = t.p.FindObjectsFinal(s)
			return nil, fmt.Errorf("pkcs11: searching objects: %s", describe(err))
		}
		out = append(out, hs...)
		if len(hs) < 64 {
			break
		}
	}
	if err := t.p.FindObjectsFinal(s); err != nil {
		return nil, fmt.Errorf("pkcs11: searching objects: %s", describe(err))
	}
	return out, nil
}

func (t *Token) stateTemplate() []*pkcs11.Attribute {
	return []*pkcs11.Attribute{
		pkcs11.NewAttribute(pkcs11.CKA_CLASS, pkcs11.CKO_DATA),
		pkcs11.NewAttribute(pkcs11.CKA_LABEL, t.cfg.KeyLabel),
		pkcs11.NewAttribute(pkcs11.CKA_APPLICATION, StateApplication),
	}
}

// readState reads the state object; a label without one has the zero state. A crash
// while the state was replaced may leave two: the one written last (highest Seq)
// counts, and the next write removes the others.
func (t *Token) readState(s pkcs11.SessionHandle) (*stateDoc, []pkcs11.ObjectHandle, error) {
	hs, err := t.find(s, t.stateTemplate())
	if err != nil {
		return nil, nil, err
	}
	doc := &stateDoc{Format: stateFormat, Versions: map[string]*versionRecord{}}
	for _, h := range hs {
		attrs, err := t.p.GetAttributeValue(s, h, []*pkcs11.Attribute{pkcs11.NewAttribute(pkcs11.CKA_VALUE, nil)})
		if err != nil {
			return nil, nil, fmt.Errorf("pkcs11: reading the state object of key label %q: %s", t.cfg.KeyLabel, describe(err))
		}
		var d stateDoc
		if err := json.Unmarshal(attrs[0].Value, &d); err != nil {
			return nil, nil, fmt.Errorf("pkcs11: the state object of key label %q is not valid: %v", t.cfg.KeyLabel, err)
		}
		if d.Format != stateFormat {
			return nil, nil, fmt.Errorf("pkcs11: the state object of key label %q has format %d; this plugin reads format %d", t.cfg.KeyLabel, d.Format, stateFormat)
		}
		if d.Seq >= doc.Seq {
			doc = &d
		}
	}
	if doc.Versions == nil {
		doc.Versions = map[string]*versionRecord{}
	}
	return doc, hs, nil
}

// writeState stores doc as a new state object, then removes the old ones (old): the
// token keeps a data object's value read-only, and in this order a crash leaves the
// old state or the new one, never none.
func (t *Token) writeState(s pkcs11.SessionHandle, old []pkcs11.ObjectHandle, doc *stateDoc) ([]pkcs11.ObjectHandle, error) {
	doc.Seq++
	raw, err := json.Marshal(doc)
	if err != nil {
		return nil, err
	}
	tmpl := append(t.stateTemplate(),
		pkcs11.NewAttribute(pkcs11.CKA_TOKEN, true),
		pkcs11.NewAttribute(pkcs11.CKA_PRIVATE, true),
		pkcs11.NewAttribute(pkcs11.CKA_VALUE, raw))
	h, err := t.p.CreateObject(s, tmpl)
	if err != nil {
		return nil, fmt.Errorf("pkcs11: writing the state object of key label %q: %s", t.cfg.KeyLabel, describe(err))
	}
	for _, o := range old {
		if err := t.p.DestroyObject(s, o); err != nil {
			return nil, fmt.Errorf("pkcs11: removing the previous state object of key label %q: %s (the new one is written; the next write retries)", t.cfg.KeyLabel, describe(err))
		}
	}
	return []pkcs11.ObjectHandle{h}, nil
}

// keyTemplate matches the key objects of the label, of version n when n > 0.
func (t *Token) keyTemplate(n uint64) []*pkcs11.Attribute {
	tmpl := []*pkcs11.Attribute{
		pkcs11.NewAttribute(pkcs11.CKA_CLASS, pkcs11.CKO_SECRET_KEY),
		pkcs11.NewAttribute(pkcs11.CKA_LABEL, t.cfg.KeyLabel),
	}
	if n > 0 {
		tmpl = append(tmpl, pkcs11.NewAttribute(pkcs11.CKA_ID, versionID(n)))
	}
	return tmpl
}

func versionID(n uint64) []byte { return []byte(strconv.FormatUint(n, 10)) }

// Current is the current version (ErrNoVersion before the first rotate).
func (t *Token) Current() (Version, error) {
	var out Version
	err := t.withSession(func(s pkcs11.SessionHandle) error {
		doc, _, err := t.readState(s)
		if err != nil {
			return err
		}
		if doc.Current == 0 {
			return fmt.Errorf("pkcs11: key label %q on token %q: %w; run the rotate command once to create version 1", t.cfg.KeyLabel, t.cfg.TokenLabel, ErrNoVersion)
		}
		out = t.version(doc, doc.Current)
		return nil
	})
	return out, err
}

func (t *Token) version(doc *stateDoc, n uint64) Version {
	v := Version{Number: n, KeyID: KeyID(t.cfg.KeyLabel, n), State: Active}
	if r := doc.Versions[strconv.FormatUint(n, 10)]; r != nil {
		v.Created = r.Created
		if r.Retired != nil {
			v.RetiredAt, v.State = *r.Retired, Retired
		}
	}
	if n == doc.Current {
		v.State = Current
	}
	return v
}

// Versions lists the versions whose key object is on the token, oldest first.
func (t *Token) Versions() ([]Version, error) {
	var out []Version
	err := t.withSession(func(s pkcs11.SessionHandle) error {
		doc, _, err := t.readState(s)
		if err != nil {
			return err
		}
		hs, err := t.find(s, t.keyTemplate(0))
		if err != nil {
			return err
		}
		for _, h := range hs {
			attrs, err := t.p.GetAttributeValue(s, h, []*pkcs11.Attribute{pkcs11.NewAttribute(pkcs11.CKA_ID, nil), pkcs11.NewAttribute(pkcs11.CKA_DECRYPT, nil)})
			if err != nil {
				return fmt.Errorf("pkcs11: reading a key of label %q: %s", t.cfg.KeyLabel, describe(err))
			}
			n, err := strconv.ParseUint(string(attrs[0].Value), 10, 64)
			if err != nil || n == 0 {
				continue // not one of ours: a key of the same label with another CKA_ID
			}
			v := t.version(doc, n)
			if v.State != Retired && !attrTrue(attrs[1]) {
				v.State = Retired
			}
			out = append(out, v)
		}
		return nil
	})
	slices.SortFunc(out, func(a, b Version) int { return cmpU(a.Number, b.Number) })
	return out, err
}

func cmpU(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func attrTrue(a *pkcs11.Attribute) bool { return len(a.Value) > 0 && a.Value[0] != 0 }

// Highest is the high-water mark: the highest version ever issued.
func (t *Token) Highest() (uint64, error) {
	var out uint64
	err := t.withSession(func(s pkcs11.SessionHandle) error {
		doc, _, err := t.readState(s)
		if doc != nil {
			out = doc.Highest
		}
		return err
	})
	return out, err
}

// RotateStep names the steps of Rotate, for tests that stop a rotation part way (a
// crash): after StepReserved the number is taken, after StepGenerated its key exists.
type RotateStep int

const (
	StepReserved RotateStep = iota + 1
	StepGenerated
	StepDone
)

// Rotate issues the next version (above the high-water mark) and makes it current.
func (t *Token) Rotate(now time.Time) (Version, error) { return t.RotateUntil(now, StepDone) }

// RotateUntil is Rotate stopped after step. The steps are ordered so that a crash
// between any two never issues a number twice: the high-water mark is raised before
// the key is generated, and the key exists before it becomes current.
func (t *Token) RotateUntil(now time.Time, step RotateStep) (Version, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out Version
	err := t.withSession(func(s pkcs11.SessionHandle) error {
		doc, h, err := t.readState(s)
		if err != nil {
			return err
		}
		n := doc.Highest + 1
		doc.Highest = n
		if h, err = t.writeState(s, h, doc); err != nil {
			return err
		}
		if step < StepGenerated {
			return nil
		}
		tmpl, err := crypto11.NewAttributeSetWithIDAndLabel(versionID(n), []byte(t.cfg.KeyLabel))
		if err != nil {
			return err
		}
		if _, err := t.c11.GenerateSecretKeyWithAttributes(tmpl, keyBits, crypto11.CipherAES); err != nil {
			return fmt.Errorf("pkcs11: generating version %d of key label %q: %s", n, t.cfg.KeyLabel, describe(err))
		}
		if step < StepDone {
			return nil
		}
		doc.Current = n
		doc.Versions[strconv.FormatUint(n, 10)] = &versionRecord{Created: now.UTC().Truncate(time.Second)}
		if _, err := t.writeState(s, h, doc); err != nil {
			return err
		}
		out = t.version(doc, n)
		return nil
	})
	return out, err
}

// Retire makes version n unable to decrypt: CKA_ENCRYPT and CKA_DECRYPT false on its
// key, and the time in the state object. The current version cannot be retired.
func (t *Token) Retire(n uint64, now time.Time) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.withSession(func(s pkcs11.SessionHandle) error {
		doc, h, err := t.readState(s)
		if err != nil {
			return err
		}
		if n == doc.Current {
			return fmt.Errorf("version %d of key label %q is current: rotate first, let the apiservers migrate to the new version, then retire it", n, t.cfg.KeyLabel)
		}
		hs, err := t.find(s, t.keyTemplate(n))
		if err != nil {
			return err
		}
		if len(hs) == 0 {
			return fmt.Errorf("version %d of key label %q: %w (list shows the versions)", n, t.cfg.KeyLabel, ErrNotFound)
		}
		for _, k := range hs {
			if err := t.p.SetAttributeValue(s, k, []*pkcs11.Attribute{
				pkcs11.NewAttribute(pkcs11.CKA_ENCRYPT, false),
				pkcs11.NewAttribute(pkcs11.CKA_DECRYPT, false),
			}); err != nil {
				return fmt.Errorf("pkcs11: disabling version %d of key label %q: %s", n, t.cfg.KeyLabel, describe(err))
			}
		}
		key := strconv.FormatUint(n, 10)
		r := doc.Versions[key]
		if r == nil {
			r = &versionRecord{}
			doc.Versions[key] = r
		}
		if r.Retired == nil {
			at := now.UTC().Truncate(time.Second)
			r.Retired = &at
		}
		_, err = t.writeState(s, h, doc)
		return err
	})
}

// Destroy deletes version n's key object. Only a retired version can be destroyed;
// its number stays issued (the high-water mark does not go down).
func (t *Token) Destroy(n uint64) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.withSession(func(s pkcs11.SessionHandle) error {
		doc, h, err := t.readState(s)
		if err != nil {
			return err
		}
		v := t.version(doc, n)
		if v.State != Retired {
			return fmt.Errorf("version %d of key label %q is %s: retire it first (retire checks that nothing needs it), then destroy it", n, t.cfg.KeyLabel, v.State)
		}
		hs, err := t.find(s, t.keyTemplate(n))
		if err != nil {
			return err
		}
		if len(hs) == 0 {
			return fmt.Errorf("version %d of key label %q: %w (already destroyed?)", n, t.cfg.KeyLabel, ErrNotFound)
		}
		for _, k := range hs {
			if err := t.p.DestroyObject(s, k); err != nil {
				return fmt.Errorf("pkcs11: destroying version %d of key label %q: %s", n, t.cfg.KeyLabel, describe(err))
			}
		}
		delete(doc.Versions, strconv.FormatUint(n, 10))
		_, err = t.writeState(s, h, doc)
		return err
	})
}

// AEAD is AES-256-GCM with version n's key, computed on the token. A retired version
// is refused (ErrRetired), as is a version without a key object (ErrNotFound).
func (t *Token) AEAD(n uint64) (cipher.AEAD, error) {
	var retired bool
	err := t.withSession(func(s pkcs11.SessionHandle) error {
		doc, _, err := t.readState(s)
		if err != nil {
			return err
		}
		retired = t.version(doc, n).State == Retired
		return nil
	})
	if err != nil {
		return nil, err
	}
	if retired {
		return nil, fmt.Errorf("version %d of key label %q: %w", n, t.cfg.KeyLabel, ErrRetired)
	}
	keys, err := t.c11.FindKeys(versionID(n), []byte(t.cfg.KeyLabel))
	if err != nil {
		return nil, fmt.Errorf("pkcs11: finding version %d of key label %q: %s", n, t.cfg.KeyLabel, describe(err))
	}
	switch len(keys) {
	case 0:
		return nil, fmt.Errorf("version %d of key label %q: %w", n, t.cfg.KeyLabel, ErrNotFound)
	case 1:
	default:
		return nil, fmt.Errorf("pkcs11: token %q holds %d keys of label %q and version %d; a version must be one key", t.cfg.TokenLabel, len(keys), t.cfg.KeyLabel, n)
	}
	a, err := keys[0].NewGCM()
	if err != nil {
		return nil, fmt.Errorf("pkcs11: AES-GCM with version %d of key label %q: %s", n, t.cfg.KeyLabel, describe(err))
	}
	return a, nil
}

// describe renders a PKCS#11 error by its return value's name (CKR_PIN_INCORRECT),
// which is all a PKCS#11 error says; nothing secret is ever part of it.
func describe(err error) string {
	var p pkcs11.Error
	if errors.As(err, &p) {
		return p.Error()
	}
	return err.Error()
}

// IsLoginError reports whether err is the token refusing the PIN or the login.
func IsLoginError(err error) bool {
	for _, rv := range []uint{pkcs11.CKR_PIN_INCORRECT, pkcs11.CKR_PIN_LOCKED, pkcs11.CKR_PIN_EXPIRED, pkcs11.CKR_PIN_INVALID, pkcs11.CKR_PIN_LEN_RANGE, pkcs11.CKR_USER_NOT_LOGGED_IN} {
		if errors.Is(err, pkcs11.Error(rv)) || strings.Contains(err.Error(), pkcs11.Error(rv).Error()) {
			return true
		}
	}
	return false
}
