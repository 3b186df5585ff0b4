package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/progress"
	"github.com/rekey-io/rekey/internal/rotation"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/migrate"
)

// forged is what a member record could carry to take over an operator's terminal: clear
// the screen, then a line of its own that looks like rekey's.
const forged = "\x1b[2J\nVERDICT forged"

// checkPrintable fails when out holds a control character other than the line breaks
// and tabs rekey writes itself, or a line forged by text read from etcd.
func checkPrintable(t *testing.T, out string) {
	t.Helper()
	if i := strings.IndexFunc(out, func(r rune) bool { return r < ' ' && r != '\n' && r != '\t' || r == 0x7f || r >= 0x80 && r <= 0x9f }); i >= 0 {
		t.Errorf("output holds control character %q at %d:\n%q", out[i], i, out)
	}
	for l := range strings.Lines(out) {
		if strings.HasPrefix(l, "VERDICT forged") {
			t.Errorf("output holds a forged line %q:\n%s", l, out)
		}
	}
}

// A member record whose id, last error, key names and KMS name carry terminal controls
// and line breaks: status prints them as one row of replacement characters, and the
// JSON escapes them (C1 controls included).
func TestStatusPrintsRecordsPrintable(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	k := cluster.Key{Provider: "aesgcm", Key: "k1" + forged}
	m := cluster.MemberState{
		APIServerID: "a" + forged, ConfigHash: "sha256:aaaa" + forged, PublishedAt: time.Now(),
		LastReloadError: "refused\x1b]0;title\x07" + forged, KMS: []cluster.KMSState{{Name: "vault\u009b2J", Healthy: true}},
		Resources: []cluster.ResourceState{{Resource: "secrets" + forged, Write: k, Read: []cluster.Key{k}}},
	}
	data, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if err := putMember(t.Context(), cli, m.APIServerID, string(data)); err != nil {
		t.Fatal(err)
	}
	out, err := run(t, "status", "--etcd-servers", srv.Endpoint)
	if err != nil && !errors.Is(err, errNotConverged) {
		t.Fatalf("status: %v\n%s", err, out)
	}
	checkPrintable(t, out)
	if !strings.Contains(out, "a\uFFFD[2J\uFFFDVERDICT forged") {
		t.Errorf("the member id is not shown with replacement characters:\n%s", out)
	}
	if rows := strings.Count(out, "\n"); rows != 4 { // header, the member, a blank line, the verdict
		t.Errorf("status printed %d lines, want 4:\n%s", rows, out)
	}
	if err != nil {
		checkPrintable(t, err.Error())
	}

	out, _ = run(t, "status", "--etcd-servers", srv.Endpoint, "-o", "json")
	checkPrintable(t, out)
	var doc struct {
		Members []cluster.MemberState `json:"members"`
	}
	if err := json.Unmarshal([]byte(out), &doc); err != nil || len(doc.Members) != 1 {
		t.Fatalf("json: %v\n%s", err, out)
	}
	if got := doc.Members[0]; got.APIServerID != m.APIServerID || got.KMS[0].Name != m.KMS[0].Name {
		t.Errorf("json changed the record: id %q, kms %q", got.APIServerID, got.KMS[0].Name)
	}
}

// rotate --wait shows what the machine reports, which names members and their errors.
func TestRotateWaitOutputPrintable(t *testing.T) {
	for _, mode := range []progress.Mode{progress.Plain, progress.Bar} {
		var b bytes.Buffer
		o := &waitOutput{p: progress.New(&b, mode), start: time.Now()}
		o.update(rotation.Ready{Action: rotation.ActionWait, Lines: []string{"member a" + forged + " refused"}, Waiting: "apiserver b" + forged})
		o.linef("reading the cluster failed (retrying): %v", errors.New("etcd says"+forged))
		o.p.Done()
		// The bar redraws its line with a carriage return and an erase: its own controls.
		checkPrintable(t, strings.ReplaceAll(b.String(), "\r\x1b[K", ""))
	}
}

// Key names and etcd keys in an inventory come from the stored data.
func TestInventoryTablePrintable(t *testing.T) {
	inv := &migrate.Inventory{Resources: []migrate.ResourceInventory{{
		Resource: "secrets", Objects: 1, Unreadable: 1, UnreadableKeys: []string{"/registry/secrets/ns/x" + forged},
		Buckets: []migrate.Count{{Bucket: migrate.Bucket{Provider: "aesgcm", Key: "k" + forged}, Objects: 1}},
	}}}
	var b bytes.Buffer
	writeTable(&b, inv)
	checkPrintable(t, b.String())
}

// An error keeps the line breaks between its items, loses every control character
// within them, and is still the error it wraps.
func TestPrintableError(t *testing.T) {
	inner := errors.New("refused:\n  - secrets: key k\x1b[2J\n  - configmaps")
	err := printableError(fmt.Errorf("wrapped: %w", inner))
	if got, want := err.Error(), "wrapped: refused:\n  - secrets: key k\uFFFD[2J\n  - configmaps"; got != want {
		t.Errorf("printableError = %q, want %q", got, want)
	}
	if !errors.Is(err, inner) {
		t.Error("printableError hides the error it wraps")
	}
	if plain := errors.New("plain"); printableError(plain) != plain {
		t.Error("a printable error was wrapped")
	}
}
