package transformers

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"net/url"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/apis/apiserver"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers/kmsdial"
)

// This file owns the rules every other package needs to read a configuration or a
// stored value the way a Set does, without building one: which prefix a key writes,
// what a prefix names, which rule serves a resource, and how the rules of a resource
// named in several entries are joined.

// Provider names of stored prefixes (SplitPrefix), as inventories, metrics and the
// status document spell them.
const (
	ProviderIdentity  = "identity"
	ProviderAESGCM    = "aesgcm"
	ProviderAESCBC    = "aescbc"
	ProviderSecretbox = "secretbox"
	ProviderKMSv2     = "kms"
	ProviderKMSv1     = "kmsv1"
	ProviderUnknown   = "unknown"
)

// KeyPrefix is the full stored prefix of one key or KMS provider: providerPrefix (e.g.
// AESGCMPrefix, KMSv2Prefix) ‖ name ‖ ':'.
func KeyPrefix(providerPrefix, name string) string { return providerPrefix + name + ":" }

// SplitPrefix turns a stored prefix into its provider and key name:
// "k8s:enc:aesgcm:v1:key1:" into (aesgcm, key1), "k8s:enc:kms:v2:plugin:" into (kms,
// plugin), "" into (identity, ""). A prefix of no provider this package knows gives
// ProviderUnknown.
func SplitPrefix(p string) (provider, key string) {
	if p == "" {
		return ProviderIdentity, ""
	}
	parts := strings.SplitN(strings.TrimPrefix(p, EncryptedMarker), ":", 3)
	if len(parts) < 2 {
		return ProviderUnknown, ""
	}
	if len(parts) == 3 {
		key = strings.TrimSuffix(parts[2], ":")
	}
	switch parts[0] + ":" + parts[1] {
	case "aesgcm:v1":
		return ProviderAESGCM, key
	case "aescbc:v1":
		return ProviderAESCBC, key
	case "secretbox:v1":
		return ProviderSecretbox, key
	case "kms:v2":
		return ProviderKMSv2, key
	case "kms:v1":
		return ProviderKMSv1, key
	}
	return ProviderUnknown, key
}

// StoredPrefix is the prefix of the values a chain entry writes, the inverse of
// SplitPrefix: "k8s:enc:aesgcm:v1:key1:", "k8s:enc:kms:v2:vault:", "" for identity (and
// for a provider this package does not know).
func (k KeyInfo) StoredPrefix() string {
	switch k.Provider {
	case ProviderAESGCM:
		return KeyPrefix(AESGCMPrefix, k.Key)
	case ProviderAESCBC:
		return KeyPrefix(AESCBCPrefix, k.Key)
	case ProviderSecretbox:
		return KeyPrefix(SecretboxPrefix, k.Key)
	case ProviderKMSv2:
		return KeyPrefix(KMSv2Prefix, k.Key)
	case ProviderKMSv1:
		return KeyPrefix(KMSv1Prefix, k.Key)
	}
	return ""
}

// Lookup finds the rule of gr in rules the way kube-apiserver does: the exact resource,
// else `<group>/*` (written `*.<group>`), else `*.*`. ok is false when none applies (the
// resource is then stored as plaintext).
func Lookup[V any](rules map[schema.GroupResource]V, gr schema.GroupResource) (v V, ok bool) {
	_, v, ok = LookupRule(rules, gr)
	return v, ok
}

// RuleCovers reports whether a rule naming rule (a resource, `<group>/*` written
// `*.<group>`, or `*.*`) applies to gr when no more specific rule does.
func RuleCovers(rule, gr schema.GroupResource) bool {
	return rule == gr || rule.Resource == "*" && (rule.Group == "*" || rule.Group == gr.Group)
}

// LookupRule is Lookup that also returns the rule's key: gr itself, or the wildcard
// that applies to it.
func LookupRule[V any](rules map[schema.GroupResource]V, gr schema.GroupResource) (rule schema.GroupResource, v V, ok bool) {
	return LookupFunc(func(k schema.GroupResource) (V, bool) { v, ok := rules[k]; return v, ok }, gr)
}

// LookupFunc is LookupRule over rules kept in another shape than a map: find returns
// the rule named exactly k, if any. A member record keeps its few rules in a list,
// and building a map for each question would cost more than the question.
func LookupFunc[V any](find func(k schema.GroupResource) (V, bool), gr schema.GroupResource) (rule schema.GroupResource, v V, ok bool) {
	for _, k := range [...]schema.GroupResource{gr, {Group: gr.Group, Resource: "*"}, {Group: "*", Resource: "*"}} {
		if v, ok = find(k); ok {
			return k, v, true
		}
	}
	return rule, v, false
}

// Entry is one entry of a configuration's `resources` list, or a description of one:
// the resources it names and its read paths in order.
type Entry[T any] struct {
	Resources []string
	Items     []T
}

// ByResource joins entries into one list per resource, as kube-apiserver does: a
// resource named in several entries reads with the earlier entry's items first. order
// lists the resources in the order they are first named.
func ByResource[T any](entries []Entry[T]) (rules map[schema.GroupResource][]T, order []schema.GroupResource) {
	rules = map[schema.GroupResource][]T{}
	for _, e := range entries {
		for _, r := range e.Resources {
			gr := schema.ParseGroupResource(r)
			if _, dup := rules[gr]; !dup {
				order = append(order, gr)
			}
			rules[gr] = append(rules[gr], e.Items...)
		}
	}
	return rules, order
}

// ConfigKey is one read path of a rule as the configuration states it: a key, identity
// or a KMS provider. It holds no key material.
type ConfigKey struct {
	// Provider is identity, aesgcm, aescbc, secretbox, kms (v2) or kmsv1 (read only).
	Provider string
	// Name is the key name or the KMS provider name.
	Name string
	// Prefix is the stored prefix of the values it writes ("" for identity).
	Prefix string
	// Fingerprint is KeyFingerprint of a local key's secret, KMSv1Fingerprint of a KMS v1
	// provider; zero for identity and KMS v2.
	Fingerprint [32]byte
	// Endpoint is a KMS provider's plugin endpoint, Timeout its call timeout.
	Endpoint string
	Timeout  time.Duration
}

// Info names the read path as a chain entry, as a Set built from it reports it:
// provider, name and a local key's check value (no KMS key id: only a running plugin
// knows it).
func (k ConfigKey) Info() KeyInfo {
	ki := KeyInfo{Provider: k.Provider, Key: k.Name}
	if k.Fingerprint != ([32]byte{}) {
		ki.Check = checkOf(k.Fingerprint)
	}
	return ki
}

// Describe lists the entries of a configuration that config.Load or config.Parse
// validated, with the read paths a Set built from it has, without building any
// provider or holding a secret. ByResource turns them into per-resource rules.
func Describe(cfg *config.Config) []Entry[ConfigKey] {
	if cfg == nil || cfg.Encryption == nil {
		return nil
	}
	out := make([]Entry[ConfigKey], 0, len(cfg.Encryption.Resources))
	for _, rc := range cfg.Encryption.Resources {
		var keys []ConfigKey
		for _, p := range rc.Providers {
			keys = append(keys, describeProvider(p)...)
		}
		out = append(out, Entry[ConfigKey]{Resources: append([]string(nil), rc.Resources...), Items: keys})
	}
	return out
}

func describeProvider(p apiserver.ProviderConfiguration) []ConfigKey {
	local := func(provider, providerPrefix string, keys []apiserver.Key) []ConfigKey {
		out := make([]ConfigKey, 0, len(keys))
		for _, k := range keys {
			secret, err := base64.StdEncoding.DecodeString(k.Secret)
			if err != nil {
				secret = []byte(k.Secret) // unreachable after validation; still a stable identity
			}
			out = append(out, ConfigKey{Provider: provider, Name: k.Name, Prefix: KeyPrefix(providerPrefix, k.Name), Fingerprint: KeyFingerprint(providerPrefix, secret)})
		}
		return out
	}
	switch {
	case p.Identity != nil:
		return []ConfigKey{{Provider: ProviderIdentity}}
	case p.AESGCM != nil:
		return local(ProviderAESGCM, AESGCMPrefix, p.AESGCM.Keys)
	case p.AESCBC != nil:
		return local(ProviderAESCBC, AESCBCPrefix, p.AESCBC.Keys)
	case p.Secretbox != nil:
		return local(ProviderSecretbox, SecretboxPrefix, p.Secretbox.Keys)
	case p.KMS != nil && p.KMS.APIVersion == KMSv1APIVersion:
		return []ConfigKey{{Provider: ProviderKMSv1, Name: p.KMS.Name, Prefix: KeyPrefix(KMSv1Prefix, p.KMS.Name), Endpoint: p.KMS.Endpoint, Fingerprint: KMSv1Fingerprint(p.KMS.Name, p.KMS.Endpoint)}}
	case p.KMS != nil:
		return []ConfigKey{{Provider: ProviderKMSv2, Name: p.KMS.Name, Prefix: KeyPrefix(KMSv2Prefix, p.KMS.Name), Endpoint: p.KMS.Endpoint, Timeout: config.KMSTimeout(p.KMS)}}
	}
	return nil
}

// fingerprintDomain separates key fingerprints from every other SHA-256 use of the
// same bytes. Persisted fingerprints depend on it: never change it.
const fingerprintDomain = "rekey.io/applied-key-fingerprint/v1\x00"

// KeyFingerprint identifies a local key's secret so that two configurations (or a
// configuration and a persisted description of one) can be compared without holding
// the key. It is not key material: it is a one-way SHA-256 hash, under a
// domain-separation string, of a uniformly random 128- to 256-bit secret; recovering
// the secret from it means searching that whole key space. It proves equality of
// secrets and nothing else.
func KeyFingerprint(providerPrefix string, secret []byte) [32]byte {
	h := sha256.New()
	h.Write([]byte(fingerprintDomain))
	h.Write([]byte(providerPrefix))
	h.Write(secret)
	var fp [32]byte
	h.Sum(fp[:0])
	return fp
}

// checkValueSize is how many bytes of KeyFingerprint a check value keeps: 64 bits tell
// two random secrets apart (a chance collision needs about 2^32 keys under one name)
// and say less about the secret than the full fingerprint does.
const checkValueSize = 8

// CheckValue is the check value of a local key that apiservers publish
// (KeyInfo.Check): the first 8 bytes of KeyFingerprint, in hex. It is the same
// function as the applied-state fingerprints, truncated; see KeyFingerprint for why it
// is not key material.
func CheckValue(providerPrefix string, secret []byte) string {
	return checkOf(KeyFingerprint(providerPrefix, secret))
}

// KMSv1Fingerprint identifies a KMS v1 provider's key by its name and endpoint, the
// way KeyFingerprint identifies a local key by its secret. KMS v1 has no key id: the
// plugin never says which key-encryption key it holds, and the stored prefix names
// only the provider. The name says which values it reads; the endpoint says which
// plugin unwraps their DEKs. Two configurations naming one provider at two sockets
// may reach two plugins with different keys, and nothing can prove otherwise, so they
// are different keys (the guard then refuses to move values' provider to a plugin that
// may not decrypt them). Two spellings of one socket are one plugin, so the endpoint
// counts as the socket it dials (kmsEndpointIdentity), not as written. Neither part is
// secret.
func KMSv1Fingerprint(name, endpoint string) [32]byte {
	return KeyFingerprint(KMSv1Prefix, []byte(name+"\x00"+kmsEndpointIdentity(endpoint)))
}

// kmsEndpointIdentity is the spelling of a KMS plugin endpoint that KMSv1Fingerprint
// hashes: the socket the client dials (kmsdial.ParseEndpoint, which reads an endpoint
// as upstream's k8s.io/kms/pkg/util.ParseEndpoint does: the URL's path; its host,
// query and fragment are ignored; "/@name" is the abstract socket "@name"), with runs
// of "/" and "." segments inside a filesystem path removed (the kernel resolves them
// alike), written back as unix://<path>. unix:/x, unix:///x, unix://host/x,
// unix:////x and unix:///x?q are then one socket with one check value. unix:///<path>
// is the spelling upstream documents and the one this returns, so a configuration
// already spelled so keeps its check value, and the applied-state fingerprints
// persisted from it still match.
//
// An endpoint that names no socket (unix://x: x is the URL's host and the path is
// empty, so nothing is dialled) or a socket no URL spells back (a filesystem path
// that begins with "/@" once cleaned would read as an abstract socket) is kept as
// written: distinct spellings then stay distinct keys, the safe side for the guard.
func kmsEndpointIdentity(endpoint string) string {
	addr, err := kmsdial.ParseEndpoint(endpoint)
	if err != nil {
		return endpoint
	}
	// An abstract socket's name is bytes, not a path: nothing to clean.
	want, path := addr, "/"+addr
	if !strings.HasPrefix(addr, "@") {
		want = cleanSocketPath(addr)
		path = want
	}
	canonical := (&url.URL{Scheme: "unix", Path: path}).String()
	if back, err := kmsdial.ParseEndpoint(canonical); err != nil || back != want {
		return endpoint
	}
	return canonical
}

// cleanSocketPath removes empty and "." segments from an absolute path, except the
// last: "/a//b" and "/a/./b" resolve as "/a/b", while a trailing "/" or "/." makes
// the kernel require a directory (a socket then fails to connect), so it stays and
// such an endpoint keeps a check value of its own. ".." is kept: through a symbolic
// link it may lead elsewhere than the lexical parent.
func cleanSocketPath(p string) string {
	segs := strings.Split(p, "/")
	out := make([]string, 1, len(segs))
	for i, s := range segs[1:] {
		if (s == "" || s == ".") && i < len(segs)-2 {
			continue
		}
		out = append(out, s)
	}
	return strings.Join(out, "/")
}

func checkOf(fp [32]byte) string { return hex.EncodeToString(fp[:checkValueSize]) }

// DescribeRules lists the resource rules of a configuration that config.Load or
// config.Parse validated the way a Set built from it reports them in Set.Rules — the
// same rules, named and ordered alike, with the same chains — without building any
// provider or holding a secret. What only a running Set knows is missing: KMS key id
// hashes and status, and a write fence's choice of writer (WriteIndex is 0).
func DescribeRules(cfg *config.Config) []RuleInfo {
	byGR, order := ByResource(Describe(cfg))
	out := make([]RuleInfo, 0, len(order))
	for _, gr := range order {
		out = append(out, describeRule(config.GroupResourceString(gr), byGR[gr]))
	}
	return out
}

// describeRule is the RuleInfo of one resource rule whose chain is keys.
func describeRule(resource string, keys []ConfigKey) RuleInfo {
	info := RuleInfo{Resource: resource}
	for _, k := range keys {
		info.ReadPrefixes = append(info.ReadPrefixes, k.Prefix)
		info.ReadKeys = append(info.ReadKeys, k.Info())
	}
	if len(keys) > 0 {
		info.WriteProvider, info.WriteKey, info.WritePrefix = keys[0].Provider, keys[0].Name, keys[0].Prefix
	}
	return info
}
