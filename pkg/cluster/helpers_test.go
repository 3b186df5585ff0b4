package cluster

import (
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// epoch is the start of every transcript's clock.
var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// parseKey reads "aesgcm/k1", "aesgcm/k1#s2" (a local key whose secret has check
// value s2; without #, every local key's check value is "s1": one secret per name),
// "aesgcm/k1#" (no check value: a record of an older rekey), "kms/vault@h1" (key id
// hash h1), "kmsv1/old#e2" (a KMS v1 provider, whose check value is its endpoint's;
// "s1" without #) or "identity".
func parseKey(s string) Key {
	s, hash, _ := strings.Cut(strings.TrimSpace(s), "@")
	s, check, hasCheck := strings.Cut(s, "#")
	p, k, _ := strings.Cut(s, "/")
	key := Key{Provider: p, Key: k, KeyIDHash: hash}
	switch p {
	case transformers.ProviderAESGCM, transformers.ProviderAESCBC, transformers.ProviderSecretbox, transformers.ProviderKMSv1:
		key.Check = "s1"
		if hasCheck {
			key.Check = check
		}
	}
	return key
}

// parseRules reads lines "<resource>: <key>,<key>..." (configuration order; a key
// marked with * writes, else the first; a rule with a key marked ! refuses writes).
func parseRules(t *testing.T, input string) []transformers.RuleInfo {
	t.Helper()
	var out []transformers.RuleInfo
	for _, line := range strings.Split(strings.TrimSpace(input), "\n") {
		if line = strings.TrimSpace(line); line == "" {
			continue
		}
		res, keys, ok := strings.Cut(line, ":")
		if !ok {
			t.Fatalf("rule line %q: want <resource>: <keys>", line)
		}
		r := transformers.RuleInfo{Resource: strings.TrimSpace(res)}
		for i, k := range strings.Split(keys, ",") {
			k = strings.TrimSpace(k)
			if strings.HasPrefix(k, "*") {
				r.WriteIndex, k = i, k[1:]
			}
			if strings.HasPrefix(k, "!") {
				r.WriteIndex, r.WriteRefused, k = transformers.NoWriter, "refused", k[1:]
			}
			r.ReadKeys = append(r.ReadKeys, parseKey(k))
		}
		out = append(out, r)
	}
	return out
}

// parseMember reads a member's state as its agent would publish it (stateFromStatus):
// rule lines as parseRules reads them, and lines
//
//	plugin <name>: writes=<hash> [reports=<hash>] [holds=<hash>]
//
// for its KMS v2 providers (reports defaults to writes). A rule whose writer is not its
// first entry holds that entry back since now; a rule written by a plugin that holds a
// key id holds that key id back since now.
func parseMember(t *testing.T, id, input string, now time.Time) MemberState {
	t.Helper()
	var ruleLines []string
	plugins := map[string]transformers.KMSStatus{}
	var st reload.Status
	for _, line := range strings.Split(strings.TrimSpace(input), "\n") {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "plugin ")
		if !ok {
			ruleLines = append(ruleLines, line)
			continue
		}
		name, fields, _ := strings.Cut(rest, ":")
		k := transformers.KMSStatus{Name: strings.TrimSpace(name), Healthy: true}
		for _, f := range strings.Fields(fields) {
			key, val, _ := strings.Cut(f, "=")
			switch key {
			case "writes":
				k.KeyIDHash = val
			case "reports":
				k.ReportedKeyIDHash = val
			case "holds":
				k.HeldKeyIDHash, k.HeldSince = val, now
			default:
				t.Fatalf("plugin line %q: unknown field %q", line, key)
			}
		}
		if k.ReportedKeyIDHash == "" {
			k.ReportedKeyIDHash = k.KeyIDHash
		}
		plugins[k.Name] = k
		st.KMSProviders = append(st.KMSProviders, k)
	}
	st.Resources = parseRules(t, strings.Join(ruleLines, "\n"))
	held := map[string]time.Time{}
	for i, r := range st.Resources {
		if r.WriteIndex > 0 {
			held[r.Resource] = now
		}
		if w, _ := r.Writer(); w.Provider == transformers.ProviderKMSv2 {
			if k, ok := plugins[w.Key]; ok {
				st.Resources[i].KMS = &k
			}
		}
	}
	return stateFromStatus(id, "", st, held, now)
}

// runTranscripts runs every testdata/<prefix>*.txt, each with the command handler
// newRun returns (a fresh machine per file).
func runTranscripts(t *testing.T, prefix string, newRun func(t *testing.T) func(*testing.T, *datadriven.TestData) string) {
	datadriven.Walk(t, "testdata", func(t *testing.T, path string) {
		if strings.HasPrefix(filepath.Base(path), prefix) {
			datadriven.RunTest(t, path, newRun(t))
		}
	})
}

// liveMembers is a transcript's live member set.
type liveMembers map[string]MemberState

// step applies `member id=<id> [gone]`: the input is the member's state (parseMember),
// gone drops it. It returns the id.
func (ms liveMembers) step(t *testing.T, d *datadriven.TestData, now time.Time) string {
	t.Helper()
	var id string
	d.ScanArgs(t, "id", &id)
	if d.HasArg("gone") {
		delete(ms, id)
	} else {
		ms[id] = parseMember(t, id, d.Input, now)
	}
	return id
}

// list returns the members sorted by id, as a view does.
func (ms liveMembers) list() []MemberState {
	return slices.SortedFunc(maps.Values(ms), func(a, b MemberState) int { return strings.Compare(a.APIServerID, b.APIServerID) })
}

// applyWriters returns rules with the writers chosen.
func applyWriters(rules []transformers.RuleInfo, w map[string]transformers.Writer) []transformers.RuleInfo {
	out := slices.Clone(rules)
	for i := range out {
		c := w[out[i].Resource]
		out[i].WriteIndex, out[i].WriteRefused = c.Index, c.Refuse
		if c.Refuse != "" {
			out[i].WriteIndex = transformers.NoWriter
		}
	}
	return out
}

func durationArg(t *testing.T, d *datadriven.TestData) time.Duration {
	t.Helper()
	if len(d.CmdArgs) != 1 {
		d.Fatalf(t, "%s: want one duration", d.Cmd)
	}
	v, err := time.ParseDuration(d.CmdArgs[0].Key)
	if err != nil {
		d.Fatalf(t, "%s: %v", d.Cmd, err)
	}
	return v
}

func ago(now, t time.Time) string { return now.Sub(t).String() }

// storedObject is a plaintext the migration accepts as a stored object (it refuses to
// rewrite anything else): a JSON Secret named after its etcd key.
func storedObject(key string) []byte {
	return fmt.Appendf(nil, `{"apiVersion":"v1","kind":"Secret","metadata":{"name":%q}}`, key)
}
