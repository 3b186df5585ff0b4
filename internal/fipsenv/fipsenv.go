// Package fipsenv sets the Go FIPS 140-3 mode of a child process through its
// environment, for the test fixtures that start programs in or out of that mode
// (internal/testbed, internal/etcdtest).
package fipsenv

import "strings"

// WithGODEBUG returns env with GODEBUG's fips140 setting replaced by mode ("off",
// "on" or "only"); GODEBUG's other settings are kept.
func WithGODEBUG(env []string, mode string) []string {
	out := make([]string, 0, len(env)+1)
	godebug := []string{"fips140=" + mode}
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "GODEBUG="); ok {
			for _, s := range strings.Split(v, ",") {
				if s != "" && !strings.HasPrefix(s, "fips140=") {
					godebug = append(godebug, s)
				}
			}
			continue
		}
		out = append(out, kv)
	}
	return append(out, "GODEBUG="+strings.Join(godebug, ","))
}
