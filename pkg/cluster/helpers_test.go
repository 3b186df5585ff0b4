package cluster

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// epoch is the start of every transcript's clock.
var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// parseKey reads "aesgcm/k1", "kms/vault@h1" (key id hash h1) or "identity".
func parseKey(s string) Key {
	s, hash, _ := strings.Cut(strings.TrimSpace(s), "@")
	p, k, _ := strings.Cut(s, "/")
	return Key{Provider: p, Key: k, KeyIDHash: hash}
}

// parseRules reads lines "<resource>: <key>,<key>..." (configuration order; a key
// marked with * writes, else the first).
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
			r.ReadKeys = append(r.ReadKeys, parseKey(k))
		}
		out = append(out, r)
	}
	return out
}

// memberFrom renders rules as a member state.
func memberFrom(id string, rules []transformers.RuleInfo) MemberState {
	m := MemberState{APIServerID: id}
	for _, r := range rules {
		m.Resources = append(m.Resources, ResourceState{Resource: r.Resource, Write: r.ReadKeys[r.WriteIndex], Read: r.ReadKeys})
	}
	return m
}

// applyWriters returns rules with the writers chosen.
func applyWriters(rules []transformers.RuleInfo, w map[string]int) []transformers.RuleInfo {
	out := slices.Clone(rules)
	for i := range out {
		out[i].WriteIndex = w[out[i].Resource]
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
