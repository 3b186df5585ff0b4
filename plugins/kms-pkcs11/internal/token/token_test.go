package token_test

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/rekey-io/rekey/plugins/kms-pkcs11/internal/softhsmtest"
	"github.com/rekey-io/rekey/plugins/kms-pkcs11/internal/token"
)

func open(t *testing.T, h *softhsmtest.Token) *token.Token {
	t.Helper()
	tok, err := token.Open(token.Config{Module: h.Module, TokenLabel: h.Label, PIN: h.PIN, KeyLabel: "kek", MaxSessions: softhsmtest.MaxSessions, SessionWait: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(tok.Close)
	return tok
}

func TestVersionsNeverReused(t *testing.T) {
	h := softhsmtest.New(t)
	tok := open(t, h)
	if _, err := tok.Current(); !errors.Is(err, token.ErrNoVersion) {
		t.Fatalf("Current on an empty label: %v, want ErrNoVersion", err)
	}
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	sealed := map[uint64][]byte{}
	nonce := make([]byte, 12)
	for i := uint64(1); i <= 3; i++ {
		v, err := tok.Rotate(now)
		if err != nil {
			t.Fatal(err)
		}
		if v.Number != i || v.State != token.Current || v.KeyID != token.KeyID("kek", i) {
			t.Fatalf("rotation %d gave %+v", i, v)
		}
		a, err := tok.AEAD(i)
		if err != nil {
			t.Fatal(err)
		}
		sealed[i] = a.Seal(nil, nonce, []byte{byte(i)}, nil)
	}
	for i, ct := range sealed {
		a, err := tok.AEAD(i)
		if err != nil {
			t.Fatal(err)
		}
		pt, err := a.Open(nil, nonce, ct, nil)
		if err != nil || !bytes.Equal(pt, []byte{byte(i)}) {
			t.Fatalf("version %d does not open its own: %v", i, err)
		}
	}
	if err := tok.Retire(3, now); err == nil {
		t.Fatal("retired the current version")
	}
	if err := tok.Destroy(2); err == nil {
		t.Fatal("destroyed a version that was not retired")
	}
	if err := tok.Retire(2, now); err != nil {
		t.Fatal(err)
	}
	if _, err := tok.AEAD(2); !errors.Is(err, token.ErrRetired) {
		t.Fatalf("AEAD of a retired version: %v", err)
	}
	if err := tok.Destroy(2); err != nil {
		t.Fatal(err)
	}
	// A rotation stopped after generating version 4 (a crash before it became
	// current): 4 is issued, its key is there; retire and destroy it, and the next
	// rotation must still skip it.
	if _, err := tok.RotateUntil(now, token.StepGenerated); err != nil {
		t.Fatal(err)
	}
	if err := tok.Retire(4, now); err != nil {
		t.Fatal(err)
	}
	if err := tok.Destroy(4); err != nil {
		t.Fatal(err)
	}
	// And one stopped after reserving 5, before its key existed.
	if _, err := tok.RotateUntil(now, token.StepReserved); err != nil {
		t.Fatal(err)
	}
	v, err := tok.Rotate(now)
	if err != nil {
		t.Fatal(err)
	}
	if v.Number != 6 {
		t.Fatalf("after the highest versions 4 (destroyed) and 5 (reserved) the next rotation issued %d, want 6", v.Number)
	}
	vs, err := tok.Versions()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, v := range vs {
		got = append(got, v.KeyID+"="+string(v.State))
	}
	want := "[kek:v1=active kek:v3=active kek:v6=current]"
	if g := fmtSlice(got); g != want {
		t.Fatalf("versions %s, want %s", g, want)
	}
	if n := tok.AdminSessionsInUse(); n != 0 {
		t.Fatalf("%d sessions still open after the calls returned", n)
	}
	// A second process's view: another Token on the same token sees the same.
	other := open(t, h)
	if c, err := other.Current(); err != nil || c.Number != 6 {
		t.Fatalf("another handle sees current %+v, %v", c, err)
	}
}

func fmtSlice(s []string) string {
	var b bytes.Buffer
	b.WriteByte('[')
	for i, x := range s {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(x)
	}
	b.WriteByte(']')
	return b.String()
}

func TestWrongPIN(t *testing.T) {
	h := softhsmtest.New(t)
	_, err := token.Open(token.Config{Module: h.Module, TokenLabel: h.Label, PIN: "wrong-pin-123", KeyLabel: "kek"})
	if err == nil || !token.IsLoginError(err) {
		t.Fatalf("wrong PIN: %v", err)
	}
	if bytes.Contains([]byte(err.Error()), []byte("wrong-pin-123")) {
		t.Fatalf("the error shows the PIN: %v", err)
	}
	t.Log(err)
}
