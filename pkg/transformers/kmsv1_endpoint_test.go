package transformers_test

import (
	"context"
	"testing"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// TestKMSv1EndpointSpellings: the check value of a KMS v1 provider follows the socket
// its endpoint dials, not how the endpoint is spelled, so a roll from unix:/x to
// unix:///x is no key change; two sockets stay two keys.
func TestKMSv1EndpointSpellings(t *testing.T) {
	check := func(endpoint string) [32]byte { return transformers.KMSv1Fingerprint("old", endpoint) }
	same := [][]string{
		{
			"unix:///var/run/kms.sock",
			"unix:/var/run/kms.sock",
			"UNIX:///var/run/kms.sock",
			"unix://localhost/var/run/kms.sock", // the host is ignored, as upstream's client ignores it
			"unix:////var//run///kms.sock",
			"unix:///var/./run/kms.sock",
			"unix:///var/run/kms.sock?x=1#frag",
			"unix:///var/run/%6Bms.sock",
		},
		{"unix:///@kms", "unix:/@kms", "unix://h/@kms"}, // the abstract socket @kms
		{"unix:///tmp/a b.sock", "unix:///tmp/a%20b.sock"},
	}
	for _, group := range same {
		for _, e := range group[1:] {
			if check(e) != check(group[0]) {
				t.Errorf("%q and %q dial one socket but have different check values", group[0], e)
			}
		}
	}
	differ := [][2]string{
		{"unix:///var/run/kms.sock", "unix:///var/run/other.sock"},
		{"unix:///@kms", "unix:////@kms"},                          // the abstract socket, a file /@kms
		{"unix:///var/run/kms.sock", "unix:///var/run/kms.sock/"},  // a trailing / needs a directory
		{"unix:///a/../kms.sock", "unix:///kms.sock"},              // .. may follow a symbolic link
		{"unix://x", "unix://y"},                                   // no socket path: kept as written
		{"unix:///var/run/kms.sock", "unix:///var/run/kms.sock/."}, // /. needs a directory too
	}
	for _, p := range differ {
		if check(p[0]) == check(p[1]) {
			t.Errorf("%q and %q have one check value, but nothing proves they reach one socket", p[0], p[1])
		}
	}
	// unix:///<path> is the canonical spelling: its value is what earlier versions
	// computed from it and persisted (applied-state fingerprints), unchanged.
	if got, want := transformers.KMSv1Fingerprint("old", "unix:///var/run/kms.sock"), transformers.KeyFingerprint(transformers.KMSv1Prefix, []byte("old\x00unix:///var/run/kms.sock")); got != want {
		t.Errorf("the canonical spelling's fingerprint changed: %x, was %x", got, want)
	}
	if a, b := transformers.KMSv1Fingerprint("old", "unix:///x.sock"), transformers.KMSv1Fingerprint("older", "unix:///x.sock"); a == b {
		t.Error("two provider names at one socket share a fingerprint")
	}
}

// TestKMSv1EndpointSpellingsMatch: a running Set and a configuration description agree
// on the normalised check value, and KeyInfo.Match (the comparison across apiservers)
// sees two spellings of one socket as the same key, two sockets as a conflict.
func TestKMSv1EndpointSpellingsMatch(t *testing.T) {
	v1 := func(endpoint string) transformers.KeyInfo {
		cfg := parseSecretsRule(t, `
  - aesgcm:
      keys:
      - {name: k1, secret: MTIzNDU2Nzg5MDEyMzQ1Ng==}
  - kms: {name: old, endpoint: "`+endpoint+`"}
`)
		set, err := transformers.Build(context.Background(), cfg, transformers.Options{})
		if err != nil {
			t.Fatal(err)
		}
		defer set.Close()
		built, described := set.Rules()[0].ReadKeys[1], transformers.DescribeRules(cfg)[0].ReadKeys[1]
		if built != described {
			t.Fatalf("%s: Set.Rules has %+v, DescribeRules %+v", endpoint, built, described)
		}
		return built
	}
	canonical := v1("unix:///tmp/rekey-kmsv1.sock")
	if got := v1("unix:/tmp/rekey-kmsv1.sock").Match(canonical); got != transformers.KeysSame {
		t.Errorf("unix:/ vs unix:/// of one socket: Match = %d, want KeysSame", got)
	}
	if got := v1("unix:///tmp/rekey-kmsv1-moved.sock").Match(canonical); got != transformers.KeysConflict {
		t.Errorf("another socket: Match = %d, want KeysConflict", got)
	}
}
