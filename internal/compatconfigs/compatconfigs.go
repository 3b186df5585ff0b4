// Package compatconfigs holds the encryption configurations of the compatibility
// matrix, so that every package that reads a configuration without building it (the
// key-in-use guard) is tested over the same configurations as pkg/transformers.
package compatconfigs

import (
	"encoding/base64"
	"strings"
)

// ProviderYAML are provider snippets to assemble configs from. Keys differ per
// provider so a value written by one provider can never be read by another by accident.
var ProviderYAML = map[string]string{
	"identity":       "      - identity: {}\n",
	"aesgcm":         "      - aesgcm:\n          keys:\n            - {name: key1, secret: " + B64(32, 1) + "}\n            - {name: key2, secret: " + B64(16, 2) + "}\n",
	"aesgcm-rev":     "      - aesgcm:\n          keys:\n            - {name: key2, secret: " + B64(16, 2) + "}\n            - {name: key1, secret: " + B64(32, 1) + "}\n",
	"aescbc":         "      - aescbc:\n          keys:\n            - {name: key1, secret: " + B64(32, 3) + "}\n            - {name: key2, secret: " + B64(24, 4) + "}\n",
	"aescbc-rev":     "      - aescbc:\n          keys:\n            - {name: key2, secret: " + B64(24, 4) + "}\n            - {name: key1, secret: " + B64(32, 3) + "}\n",
	"secretbox":      "      - secretbox:\n          keys:\n            - {name: key1, secret: " + B64(32, 5) + "}\n            - {name: key2, secret: " + B64(32, 6) + "}\n",
	"secretbox-rev":  "      - secretbox:\n          keys:\n            - {name: key2, secret: " + B64(32, 6) + "}\n            - {name: key1, secret: " + B64(32, 5) + "}\n",
	"aescbc-other":   "      - aescbc:\n          keys:\n            - {name: key1, secret: " + B64(32, 7) + "}\n", // same prefix as aescbc key1, different key
	"aesgcm-only-k2": "      - aesgcm:\n          keys:\n            - {name: key2, secret: " + B64(16, 2) + "}\n",
	// Key names where one prefix is a proper prefix of the other; the long name is 15
	// characters after "a:", so its values are block-aligned after the short prefix.
	"aescbc-short-first": "      - aescbc:\n          keys:\n            - {name: a, secret: " + B64(32, 8) + "}\n            - {name: '" + LongCBCName + "', secret: " + B64(32, 9) + "}\n",
	"aescbc-long-first":  "      - aescbc:\n          keys:\n            - {name: '" + LongCBCName + "', secret: " + B64(32, 9) + "}\n            - {name: a, secret: " + B64(32, 8) + "}\n",
}

// LongCBCName shares the prefix "a:" with the key name "a".
const LongCBCName = "a:bcdefghijklmnop"

// B64 is a deterministic n-byte test key, base64-encoded.
func B64(n int, seed byte) string {
	k := make([]byte, n)
	for i := range k {
		k[i] = seed*31 + byte(i)*7 + 1
	}
	return base64.StdEncoding.EncodeToString(k)
}

// ConfigFor is a configuration with one entry: resources, read with providers in order.
func ConfigFor(resources string, providers ...string) string {
	var b strings.Builder
	b.WriteString(header + "  - resources: [" + resources + "]\n    providers:\n")
	for _, p := range providers {
		b.WriteString(ProviderYAML[p])
	}
	return b.String()
}

const header = "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n"

// Orders are the provider lists of the cross-read matrix, for ConfigFor.
var Orders = [][]string{
	{"identity"},
	{"aesgcm"}, {"aesgcm-rev"}, {"aesgcm-only-k2"},
	{"aescbc"}, {"aescbc-rev"},
	{"secretbox"}, {"secretbox-rev"},
	{"identity", "aesgcm", "aescbc", "secretbox"},
	{"aesgcm", "secretbox", "aescbc", "identity"},
	{"aescbc", "identity", "secretbox", "aesgcm"},
	{"secretbox", "aescbc", "identity", "aesgcm"},
	{"aesgcm-rev", "aescbc-rev", "secretbox-rev"},
	{"aescbc-other", "aescbc"}, // overlapping prefixes: a failing provider must not stop the search
	{"aescbc", "aescbc-other"},
	{"aescbc-short-first"}, {"aescbc-long-first"},
}

// Lookup is a configuration of several entries that exercises every lookup: exact
// names, a resource named in two entries (its providers are appended), `*.apps` and
// `*.*`.
var Lookup = header +
	"  - resources: [secrets, configmaps]\n    providers:\n" + ProviderYAML["aesgcm"] + ProviderYAML["identity"] +
	"  - resources: ['*.apps']\n    providers:\n" + ProviderYAML["secretbox"] +
	"  - resources: [secrets]\n    providers:\n" + ProviderYAML["aescbc"] + // appended to secrets' list
	"  - resources: ['*.*']\n    providers:\n" + ProviderYAML["aescbc-rev"]

// Matrix names every configuration a reader of configurations that does not build them
// is tested over: Lookup, and each of Orders serving an exact resource (secrets), a
// group wildcard next to an exact resource (configmaps, `*.apps`) and everything
// (`*.*`).
func Matrix() map[string]string {
	configs := map[string]string{"lookup": Lookup}
	for _, o := range Orders {
		name := strings.Join(o, ",")
		configs["secrets:"+name] = ConfigFor("secrets", o...)
		configs["group:"+name] = ConfigFor("configmaps, '*.apps'", o...)
		configs["any:"+name] = ConfigFor("'*.*'", o...)
	}
	return configs
}
