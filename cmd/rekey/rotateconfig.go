package main

import (
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	apiserverv1 "k8s.io/apiserver/pkg/apis/apiserver/v1"
	"sigs.k8s.io/yaml"

	"github.com/rekey-io/rekey/pkg/config"
)

// Provider types rotate can write with.
const (
	providerAESGCM    = "aesgcm"
	providerAESCBC    = "aescbc"
	providerSecretbox = "secretbox"
	providerKMS       = "kms"
)

// localKeySize is the key length rotate generates for every local provider: AES-256 for
// aesgcm and aescbc, and secretbox only accepts 32 bytes.
const localKeySize = 32

// rotation is one requested key change, independent of any file.
type rotation struct {
	// provider is the type to write with; "" keeps the type each rule writes with now.
	provider string
	// kmsName and kmsEndpoint describe the KMS v2 provider added when provider is "kms".
	kmsName     string
	kmsEndpoint string
	kmsTimeout  time.Duration
	// resources limits the rules rotated to those naming one of them (as written in the file).
	resources []string
	// now names the generated key; random fills its secret.
	now    time.Time
	random io.Reader
}

// rotateResult says what rotateAdd changed.
type rotateResult struct {
	cfg *apiserverv1.EncryptionConfiguration
	// rules are the indexes of the rotated resources entries.
	rules []int
	// newKey names the new write key: a local key name, or the KMS provider's name.
	newKey string
	// oldKeys are the write keys it replaced, one per distinct name ("identity" for
	// identity), for the second step (--remove-old).
	oldKeys []string
	// warnings are printed to the operator (aescbc's deprecation).
	warnings []string
}

// decodeExternal reads the file's bytes as the versioned object, without defaults, so the
// file written back keeps only what the operator wrote (plus the new key). Comments are
// not kept: YAML is re-rendered from the object.
func decodeExternal(data []byte) (*apiserverv1.EncryptionConfiguration, error) {
	var cfg apiserverv1.EncryptionConfiguration
	if err := yaml.UnmarshalStrict(data, &cfg); err != nil {
		return nil, fmt.Errorf("decoding the encryption configuration: %s", config.DescribeDecodeError(err, "EncryptionConfiguration"))
	}
	return &cfg, nil
}

func encodeExternal(cfg *apiserverv1.EncryptionConfiguration) ([]byte, error) {
	return yaml.Marshal(cfg)
}

// writeProviderType names the type of a provider entry.
func writeProviderType(p apiserverv1.ProviderConfiguration) string {
	switch {
	case p.AESGCM != nil:
		return providerAESGCM
	case p.AESCBC != nil:
		return providerAESCBC
	case p.Secretbox != nil:
		return providerSecretbox
	case p.KMS != nil:
		return providerKMS
	case p.Identity != nil:
		return "identity"
	}
	return ""
}

func isLocal(kind string) bool {
	return kind == providerAESGCM || kind == providerAESCBC || kind == providerSecretbox
}

// selectRules picks the rules a rotation changes. Default: every rule whose write
// provider is a local key. When none does and a type is asked for, the rules that
// write identity (first-time encryption). A switch to KMS also takes rules writing KMS
// v2 (a move to a second plugin), and must select exactly one rule: KMS v2 provider names
// are unique across the whole file. --resources keeps only rules naming one of them.
func selectRules(cfg *apiserverv1.EncryptionConfiguration, r rotation) ([]int, error) {
	named := func(rc apiserverv1.ResourceConfiguration) bool { return namesAny(rc, r.resources) }
	pick := func(ok func(kind string) bool) []int {
		var out []int
		for i, rc := range cfg.Resources {
			if len(rc.Providers) > 0 && named(rc) && ok(writeProviderType(rc.Providers[0])) {
				out = append(out, i)
			}
		}
		return out
	}
	var rules []int
	if r.provider == providerKMS {
		rules = pick(func(k string) bool {
			return isLocal(k) || k == providerKMS || (len(r.resources) > 0 && k == "identity")
		})
		if len(rules) == 0 {
			// First-time encryption straight to a KMS plugin, as with a local type.
			rules = pick(func(k string) bool { return k == "identity" })
		}
		if len(rules) > 1 {
			return nil, fmt.Errorf("--provider kms would rotate %d rules (%s), but a KMS v2 provider name may appear only once in a configuration; choose one with --resources and run rotate once per rule with its own --kms-name", len(rules), ruleNames(cfg, rules))
		}
	} else {
		rules = pick(isLocal)
		if len(rules) == 0 && r.provider != "" {
			rules = pick(func(k string) bool { return k == "identity" })
		}
	}
	if len(rules) == 0 {
		what := "writes with a local key (aesgcm, aescbc or secretbox)"
		if r.provider == providerKMS {
			what = "writes with a local key, KMS v2 or identity"
		}
		if r.provider == "" {
			what += "; to encrypt for the first time, pass --provider aesgcm"
		}
		if len(r.resources) > 0 {
			return nil, fmt.Errorf("no rule naming %s %s", strings.Join(r.resources, ", "), what)
		}
		return nil, fmt.Errorf("no rule in the configuration %s", what)
	}
	return rules, nil
}

// namesAny reports whether rule rc names one of resources as written in the file (any
// rule when resources is empty): the --resources filter of both steps.
func namesAny(rc apiserverv1.ResourceConfiguration, resources []string) bool {
	if len(resources) == 0 {
		return true
	}
	for _, want := range resources {
		if slices.Contains(rc.Resources, want) {
			return true
		}
	}
	return false
}

func ruleNames(cfg *apiserverv1.EncryptionConfiguration, rules []int) string {
	var s []string
	for _, i := range rules {
		s = append(s, strings.Join(cfg.Resources[i].Resources, ","))
	}
	return strings.Join(s, "; ")
}

// allNames lists every local key name and KMS provider name in cfg.
func allNames(cfg *apiserverv1.EncryptionConfiguration) (keys, kms []string) {
	for _, rc := range cfg.Resources {
		for _, p := range rc.Providers {
			for _, a := range []*apiserverv1.AESConfiguration{p.AESGCM, p.AESCBC} {
				if a != nil {
					for _, k := range a.Keys {
						keys = append(keys, k.Name)
					}
				}
			}
			if p.Secretbox != nil {
				for _, k := range p.Secretbox.Keys {
					keys = append(keys, k.Name)
				}
			}
			if p.KMS != nil {
				kms = append(kms, p.KMS.Name)
			}
		}
	}
	return keys, kms
}

// newKeyName is "key-<UTC time>", a second later when another key name equals it,
// starts with it or is a start of it: a key name that is a prefix of another makes one
// key's stored prefix a prefix of the other's once a ':' is involved, and reading then
// depends on try order (see transformers' chain). The name never contains ':'.
func newKeyName(now time.Time, existing []string) (string, error) {
	const layout = "key-20060102T150405Z"
	clash := func(n string) bool {
		for _, e := range existing {
			if strings.HasPrefix(e, n) || strings.HasPrefix(n, e) {
				return true
			}
		}
		return false
	}
	// A suffix would make the taken name a prefix of the new one, so a clash moves the
	// time in the name on by a second instead.
	for i := range 1000 {
		if name := now.UTC().Add(time.Duration(i) * time.Second).Format(layout); !clash(name) {
			return name, nil
		}
	}
	return "", fmt.Errorf("every key name rotate can generate clashes with an existing name (equal, or one a prefix of the other); rename the keys named like %q", now.UTC().Format(layout))
}

// rotateAdd returns a copy of cfg with a new write key first in every selected rule;
// the previous write key stays as a read key right behind it.
func rotateAdd(in *apiserverv1.EncryptionConfiguration, r rotation) (*rotateResult, error) {
	cfg := in.DeepCopy()
	rules, err := selectRules(cfg, r)
	if err != nil {
		return nil, err
	}
	res := &rotateResult{cfg: cfg, rules: rules}
	for _, i := range rules {
		if old := oldName(cfg.Resources[i]); !slices.Contains(res.oldKeys, old) {
			res.oldKeys = append(res.oldKeys, old)
		}
	}
	keys, kmsNames := allNames(cfg)
	if r.provider == providerKMS {
		if err := checkKMSFlags(r, kmsNames); err != nil {
			return nil, err
		}
		kc := &apiserverv1.KMSConfiguration{APIVersion: "v2", Name: r.kmsName, Endpoint: r.kmsEndpoint}
		if r.kmsTimeout > 0 {
			kc.Timeout = &metav1.Duration{Duration: r.kmsTimeout}
		}
		rc := &cfg.Resources[rules[0]]
		rc.Providers = slices.Insert(rc.Providers, 0, apiserverv1.ProviderConfiguration{KMS: kc})
		res.newKey = r.kmsName
		return res, nil
	}
	secret := make([]byte, localKeySize)
	if _, err := io.ReadFull(r.random, secret); err != nil {
		return nil, fmt.Errorf("generating a key: %w", err)
	}
	name, err := newKeyName(r.now, keys)
	if err != nil {
		return nil, err
	}
	key := apiserverv1.Key{Name: name, Secret: base64.StdEncoding.EncodeToString(secret)}
	res.newKey = key.Name
	for _, i := range rules {
		rc := &cfg.Resources[i]
		kind := r.provider
		cur := writeProviderType(rc.Providers[0])
		if kind == "" {
			kind = cur
		}
		if kind == providerAESCBC && !slices.Contains(res.warnings, aescbcWarning) {
			res.warnings = append(res.warnings, aescbcWarning)
		}
		if kind == cur {
			// Same type: the new key goes first in the write provider's own list.
			p := &rc.Providers[0]
			switch kind {
			case providerAESGCM:
				p.AESGCM.Keys = slices.Insert(p.AESGCM.Keys, 0, key)
			case providerAESCBC:
				p.AESCBC.Keys = slices.Insert(p.AESCBC.Keys, 0, key)
			case providerSecretbox:
				p.Secretbox.Keys = slices.Insert(p.Secretbox.Keys, 0, key)
			}
			continue
		}
		var p apiserverv1.ProviderConfiguration
		keys := []apiserverv1.Key{key}
		switch kind {
		case providerAESGCM:
			p.AESGCM = &apiserverv1.AESConfiguration{Keys: keys}
		case providerAESCBC:
			p.AESCBC = &apiserverv1.AESConfiguration{Keys: keys}
		case providerSecretbox:
			p.Secretbox = &apiserverv1.SecretboxConfiguration{Keys: keys}
		default:
			return nil, fmt.Errorf("--provider %q is not one rotate writes with; use aesgcm, secretbox, aescbc or kms", kind)
		}
		rc.Providers = slices.Insert(rc.Providers, 0, p)
	}
	return res, nil
}

const aescbcWarning = "WARNING: aescbc is deprecated upstream (it is vulnerable to padding-oracle attacks and upstream plans to remove it); prefer --provider aesgcm or kms"

func checkKMSFlags(r rotation, existing []string) error {
	switch {
	case r.kmsName == "":
		return errors.New("--provider kms needs --kms-name: the name of the new KMS v2 provider")
	case strings.Contains(r.kmsName, ":"):
		return fmt.Errorf("--kms-name %q contains ':', which KMS v2 provider names may not", r.kmsName)
	case slices.Contains(existing, r.kmsName):
		return fmt.Errorf("--kms-name %q is already a KMS provider in the configuration; a new plugin needs a new name (the old provider stays for reads until it is removed)", r.kmsName)
	case !strings.HasPrefix(r.kmsEndpoint, "unix:///"):
		return fmt.Errorf("--kms-endpoint %q must be a unix socket path (unix:///path/to/socket): KMS v2 plugins listen on local sockets", r.kmsEndpoint)
	}
	return nil
}

// writeKeyName names the write key of a rule: the first local key's name, the KMS
// provider's name, or "" for identity.
func writeKeyName(rc apiserverv1.ResourceConfiguration) string {
	if len(rc.Providers) == 0 {
		return ""
	}
	p := rc.Providers[0]
	switch {
	case p.AESGCM != nil && len(p.AESGCM.Keys) > 0:
		return p.AESGCM.Keys[0].Name
	case p.AESCBC != nil && len(p.AESCBC.Keys) > 0:
		return p.AESCBC.Keys[0].Name
	case p.Secretbox != nil && len(p.Secretbox.Keys) > 0:
		return p.Secretbox.Keys[0].Name
	case p.KMS != nil:
		return p.KMS.Name
	}
	return ""
}

// oldName names a rule's write key as --remove-old takes it: the local key's or KMS
// provider's name, or "identity".
func oldName(rc apiserverv1.ResourceConfiguration) string {
	if n := writeKeyName(rc); n != "" {
		return n
	}
	return "identity"
}

func keysOf(p apiserverv1.ProviderConfiguration) []apiserverv1.Key {
	switch {
	case p.AESGCM != nil:
		return p.AESGCM.Keys
	case p.AESCBC != nil:
		return p.AESCBC.Keys
	case p.Secretbox != nil:
		return p.Secretbox.Keys
	}
	return nil
}

func setKeys(p *apiserverv1.ProviderConfiguration, keys []apiserverv1.Key) {
	switch {
	case p.AESGCM != nil:
		p.AESGCM.Keys = keys
	case p.AESCBC != nil:
		p.AESCBC.Keys = keys
	case p.Secretbox != nil:
		p.Secretbox.Keys = keys
	}
}

// rotateDrop returns a copy of cfg without the read key named old (a local key, a KMS
// provider, or "identity") in every rule that writes with another key and names one of
// resources (every such rule when resources is empty: the rules step 1 rotated). A rule
// whose write key is old keeps it: removing a write key is a new rotation, not a
// clean-up. Running it again finds nothing to remove.
func rotateDrop(in *apiserverv1.EncryptionConfiguration, old string, resources []string) (*apiserverv1.EncryptionConfiguration, []int, error) {
	cfg := in.DeepCopy()
	var rules []int
	for i := range cfg.Resources {
		rc := &cfg.Resources[i]
		if len(rc.Providers) == 0 || oldName(*rc) == old || !namesAny(*rc, resources) {
			continue
		}
		removed := false
		for j := 1; j < len(rc.Providers); j++ {
			p := &rc.Providers[j]
			switch {
			case p.KMS != nil && p.KMS.Name == old, p.Identity != nil && old == "identity":
				rc.Providers = slices.Delete(rc.Providers, j, j+1)
				j--
				removed = true
				continue
			}
			ks := keysOf(*p)
			if k := slices.IndexFunc(ks, func(k apiserverv1.Key) bool { return k.Name == old }); k >= 0 {
				removed = true
				if len(ks) == 1 {
					rc.Providers = slices.Delete(rc.Providers, j, j+1)
					j--
					continue
				}
				setKeys(p, slices.Delete(slices.Clone(ks), k, k+1))
			}
		}
		// Behind a local write key, the old key may be in the write provider's own list.
		if ks := keysOf(rc.Providers[0]); len(ks) > 1 {
			if k := slices.IndexFunc(ks[1:], func(k apiserverv1.Key) bool { return k.Name == old }); k >= 0 {
				setKeys(&rc.Providers[0], slices.Delete(slices.Clone(ks), k+1, k+2))
				removed = true
			}
		}
		if removed {
			rules = append(rules, i)
		}
	}
	if len(rules) == 0 {
		if len(resources) > 0 {
			return nil, nil, fmt.Errorf("no rule naming %s holds %q as a read key behind another write key; nothing to remove", strings.Join(resources, ", "), old)
		}
		return nil, nil, fmt.Errorf("no rule holds %q as a read key behind another write key; nothing to remove", old)
	}
	return cfg, rules, nil
}
