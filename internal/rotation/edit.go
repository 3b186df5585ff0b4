package rotation

import (
	"cmp"
	"encoding/base32"
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
	"github.com/rekey-io/rekey/pkg/transformers"
)

// This file holds the two edits `rekey rotate` makes to an encryption configuration
// file, pure (the caller reads and writes the file, and passes the clock and the key
// source): Add puts a new write key first, Remove takes the keys it replaced out. What a
// rule writes and reads with comes from transformers.Describe, the rule every other
// package reads a configuration by; only the edit itself works on the file's versioned
// object, so the file written back keeps what the operator wrote and gains no defaults.

// localKeySize is the key length rotate generates for every local provider: AES-256 for
// aesgcm and aescbc, and secretbox only accepts 32 bytes.
const localKeySize = 32

// Request is one key change, independent of any file.
type Request struct {
	// Provider is the type to write with (transformers.ProviderAESGCM, ProviderAESCBC,
	// ProviderSecretbox or ProviderKMSv2); "" keeps the type each rule writes with now.
	Provider string
	// KMSName, KMSEndpoint and KMSTimeout describe the KMS v2 provider added when
	// Provider is ProviderKMSv2 (KMSTimeout 0: the apiserver's default).
	KMSName     string
	KMSEndpoint string
	KMSTimeout  time.Duration
	// Resources limits the rules rotated to those naming one of them (as written in the
	// file); empty: every rule.
	Resources []string
	// Random fills the generated key's secret, then the random part of its name; Now is
	// the time in its name.
	Now    time.Time
	Random io.Reader
}

// File is an encryption configuration as rotate edits it.
type File struct {
	// Config is the file validated as an apiserver would (pkg/config).
	Config *config.Config
	// rules describes Config's resources entries in file order (transformers.Describe),
	// index for index with versioned.Resources.
	rules []transformers.Entry[transformers.ConfigKey]
	// versioned is the file's object as written, without defaults: what an edit changes
	// and renders again. Comments are not kept.
	versioned *apiserverv1.EncryptionConfiguration
}

// ParseFile validates data as pkg/config does for source and decodes it for editing. A
// configuration that is not valid is an error: rotate never edits one.
func ParseFile(data []byte, source string) (*File, error) {
	cfg, err := config.Parse(data, source, config.Options{Reload: true})
	if err != nil {
		return nil, err
	}
	var versioned apiserverv1.EncryptionConfiguration
	if err := yaml.UnmarshalStrict(data, &versioned); err != nil {
		return nil, fmt.Errorf("decoding the encryption configuration: %s", config.DescribeDecodeError(err, "EncryptionConfiguration"))
	}
	rules := transformers.Describe(cfg)
	if len(rules) != len(versioned.Resources) {
		// Both come from the same bytes; a mismatch is a bug, never the operator's.
		return nil, fmt.Errorf("%s: %d resources entries decoded, %d validated; report this as a bug of rekey", source, len(versioned.Resources), len(rules))
	}
	return &File{Config: cfg, rules: rules, versioned: &versioned}, nil
}

// Edit is a file's next content.
type Edit struct {
	// Data is the new file content; Config is Data validated as an apiserver would.
	Data   []byte
	Config *config.Config
	// Summary says what changed in one line: rules and key names, never key material.
	Summary string
	// Warnings are for the operator (aescbc's deprecation).
	Warnings []string
	// NewKey names Add's new write key: a local key name, or the KMS provider's name.
	NewKey string
	// OldKeys are the write keys Add replaced, one per distinct name, as Remove takes
	// them: a local key name, a KMS provider name, or "identity".
	OldKeys []string
	// Rules are the indexes of the resources entries the edit changed.
	Rules []int
}

// Add returns f with a new write key first in every rule r selects; the previous write
// key stays right behind it for reads. The result is validated.
func Add(f *File, r Request) (*Edit, error) {
	rules, err := f.selectRules(r)
	if err != nil {
		return nil, err
	}
	cfg := f.versioned.DeepCopy()
	e := &Edit{Rules: rules}
	for _, i := range rules {
		if old := f.writeKeyName(i); !slices.Contains(e.OldKeys, old) {
			e.OldKeys = append(e.OldKeys, old)
		}
	}
	if r.Provider == transformers.ProviderKMSv2 {
		_, kmsNames := f.names()
		if err := checkKMSFlags(r, kmsNames); err != nil {
			return nil, err
		}
		kc := &apiserverv1.KMSConfiguration{APIVersion: "v2", Name: r.KMSName, Endpoint: r.KMSEndpoint}
		if r.KMSTimeout > 0 {
			kc.Timeout = &metav1.Duration{Duration: r.KMSTimeout}
		}
		rc := &cfg.Resources[rules[0]]
		rc.Providers = slices.Insert(rc.Providers, 0, apiserverv1.ProviderConfiguration{KMS: kc})
		e.NewKey = r.KMSName
	} else if err := f.addLocalKey(cfg, rules, r, e); err != nil {
		return nil, err
	}
	if err := e.render(cfg, f.Config.Source+" (rotated)"); err != nil {
		return nil, fmt.Errorf("the rotated configuration would not be valid (file left alone): %w", err)
	}
	e.Summary = fmt.Sprintf("new write key %q first in %s; the previous write key stays for reads", e.NewKey, ruleNames(cfg, rules))
	return e, nil
}

// addLocalKey generates the new local key and puts it first in rules of cfg.
func (f *File) addLocalKey(cfg *apiserverv1.EncryptionConfiguration, rules []int, r Request, e *Edit) error {
	secret := make([]byte, localKeySize)
	if _, err := io.ReadFull(r.Random, secret); err != nil {
		return fmt.Errorf("generating a key: %w", err)
	}
	keys, _ := f.names()
	name, err := newKeyName(r.Now, keys, r.Random)
	if err != nil {
		return err
	}
	key := apiserverv1.Key{Name: name, Secret: base64.StdEncoding.EncodeToString(secret)}
	e.NewKey = key.Name
	for _, i := range rules {
		rc := &cfg.Resources[i]
		cur := f.writeType(i)
		kind := cmp.Or(r.Provider, cur)
		if kind == transformers.ProviderAESCBC && !slices.Contains(e.Warnings, aescbcWarning) {
			e.Warnings = append(e.Warnings, aescbcWarning)
		}
		if kind == cur {
			// Same type: the new key goes first in the write provider's own list.
			setKeys(&rc.Providers[0], slices.Insert(slices.Clone(keysOf(rc.Providers[0])), 0, key))
			continue
		}
		var p apiserverv1.ProviderConfiguration
		keys := []apiserverv1.Key{key}
		switch kind {
		case transformers.ProviderAESGCM:
			p.AESGCM = &apiserverv1.AESConfiguration{Keys: keys}
		case transformers.ProviderAESCBC:
			p.AESCBC = &apiserverv1.AESConfiguration{Keys: keys}
		case transformers.ProviderSecretbox:
			p.Secretbox = &apiserverv1.SecretboxConfiguration{Keys: keys}
		default:
			return fmt.Errorf("--provider %q is not one rotate writes with; use aesgcm, secretbox, aescbc or kms", kind)
		}
		rc.Providers = slices.Insert(rc.Providers, 0, p)
	}
	return nil
}

const aescbcWarning = "WARNING: aescbc is deprecated upstream (it is vulnerable to padding-oracle attacks and upstream plans to remove it); prefer --provider aesgcm or kms"

func checkKMSFlags(r Request, existing []string) error {
	switch {
	case r.KMSName == "":
		return errors.New("--provider kms needs --kms-name: the name of the new KMS v2 provider")
	case strings.Contains(r.KMSName, ":"):
		return fmt.Errorf("--kms-name %q contains ':', which KMS v2 provider names may not", r.KMSName)
	case slices.Contains(existing, r.KMSName):
		return fmt.Errorf("--kms-name %q is already a KMS provider in the configuration; a new plugin needs a new name (the old provider stays for reads until it is removed)", r.KMSName)
	case !strings.HasPrefix(r.KMSEndpoint, "unix:///"):
		return fmt.Errorf("--kms-endpoint %q must be a unix socket path (unix:///path/to/socket): KMS v2 plugins listen on local sockets", r.KMSEndpoint)
	}
	return nil
}

// Remove returns f without the read keys names (local key names, KMS provider names, or
// "identity") in every rule that writes with another key and names one of resources
// (every such rule when resources is empty: the rules Add rotated). A rule whose write
// key is one of names keeps it: removing a write key is a new rotation, not a clean-up.
// Run again, it finds nothing to remove. The result is validated; whether stored data
// still needs a removed key is the caller's guard to check.
func Remove(f *File, names, resources []string) (*Edit, error) {
	cfg := f.versioned.DeepCopy()
	e := &Edit{}
	var parts []string
	for _, name := range names {
		rules, err := f.drop(cfg, name, resources)
		if err != nil {
			return nil, err
		}
		parts = append(parts, fmt.Sprintf("removed the read key %q from %s", name, ruleNames(cfg, rules)))
		for _, i := range rules {
			if !slices.Contains(e.Rules, i) {
				e.Rules = append(e.Rules, i)
			}
		}
	}
	if err := e.render(cfg, f.Config.Source+" (without the old key)"); err != nil {
		return nil, fmt.Errorf("removing the old key would give an invalid configuration (file left alone): %w", err)
	}
	e.Summary = strings.Join(parts, "; ")
	return e, nil
}

// drop removes the read key old from the rules of cfg that Remove concerns and returns
// their indexes. The write keys of f still describe cfg: a drop never touches one.
func (f *File) drop(cfg *apiserverv1.EncryptionConfiguration, old string, resources []string) ([]int, error) {
	var rules []int
	for i := range cfg.Resources {
		rc := &cfg.Resources[i]
		if len(rc.Providers) == 0 || f.writeKeyName(i) == old || !namesAny(rc.Resources, resources) {
			continue
		}
		removed := false
		for j := 1; j < len(rc.Providers); j++ {
			p := &rc.Providers[j]
			if (p.KMS != nil && p.KMS.Name == old) || (p.Identity != nil && old == transformers.ProviderIdentity) {
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
			return nil, fmt.Errorf("no rule naming %s holds %q as a read key behind another write key; nothing to remove", strings.Join(resources, ", "), old)
		}
		return nil, fmt.Errorf("no rule holds %q as a read key behind another write key; nothing to remove", old)
	}
	return rules, nil
}

// render sets e.Data to cfg's YAML and e.Config to it validated.
func (e *Edit) render(cfg *apiserverv1.EncryptionConfiguration, source string) error {
	data, err := yaml.Marshal(cfg)
	if err != nil {
		return err
	}
	parsed, err := config.Parse(data, source, config.Options{Reload: true})
	if err != nil {
		return err
	}
	e.Data, e.Config = data, parsed
	return nil
}

// StoredFunc resolves a rule's resources as written in the file into the resources
// stored under it (a wildcard rule into what is actually stored).
type StoredFunc func(ruleResources []string) []string

// NamedResources is the StoredFunc that knows no layout: a rule's resources as
// written, without wildcards.
func NamedResources(ruleResources []string) []string {
	var out []string
	for _, r := range ruleResources {
		if !strings.Contains(r, "*") {
			out = append(out, r)
		}
	}
	return out
}

// Read is f as the machine sees it for the rotation r: its hash, the rules a rotation
// may concern (those writing with a local key or KMS v2 and naming one of r.Resources,
// every such rule when it is empty), and the resources the first edit would change.
// stored resolves the resources of a rule (nil: NamedResources).
func (f *File) Read(r Request, stored StoredFunc) FileRead {
	if stored == nil {
		stored = NamedResources
	}
	fr := FileRead{Hash: f.Config.Hash}
	for i, e := range f.rules {
		if kind := f.writeType(i); (isLocal(kind) || kind == transformers.ProviderKMSv2) && namesAny(e.Resources, r.Resources) {
			ru := rule(e)
			ru.Stored = stored(e.Resources)
			fr.Rules = append(fr.Rules, ru)
		}
	}
	// No rule to change is the first edit's error to report, not the machine's.
	changed, _ := f.selectRules(r)
	for _, res := range f.RuleResources(changed) {
		for _, s := range stored(res) {
			if !slices.Contains(fr.Rotates, s) {
				fr.Rotates = append(fr.Rotates, s)
			}
		}
	}
	return fr
}

// RuleResources are the resources, as written, of the resources entries at indexes
// (Edit.Rules).
func (f *File) RuleResources(indexes []int) [][]string {
	var out [][]string
	for _, i := range indexes {
		out = append(out, slices.Clone(f.rules[i].Resources))
	}
	return out
}

// Rules lists cfg's resources entries with their chains as the apiservers publish them.
func Rules(cfg *config.Config) []Rule {
	var out []Rule
	for _, e := range transformers.Describe(cfg) {
		if len(e.Items) > 0 {
			out = append(out, rule(e))
		}
	}
	return out
}

// rule names an entry's chain the way the apiservers publish it: provider, key name and
// check value, no KMS key id (the file does not know it).
func rule(e transformers.Entry[transformers.ConfigKey]) Rule {
	r := Rule{Resources: slices.Clone(e.Resources)}
	for _, k := range e.Items {
		r.Entries = append(r.Entries, k.Info())
	}
	return r
}

// selectRules picks the rules a rotation changes. Default: every rule whose write
// provider is a local key. When none does and a type is asked for, the rules that
// write identity (first-time encryption). A switch to KMS also takes rules writing KMS
// v2 (a move to a second plugin), and must select exactly one rule: KMS v2 provider names
// are unique across the whole file. r.Resources keeps only rules naming one of them.
func (f *File) selectRules(r Request) ([]int, error) {
	pick := func(ok func(kind string) bool) []int {
		var out []int
		for i, e := range f.rules {
			if len(e.Items) > 0 && namesAny(e.Resources, r.Resources) && ok(f.writeType(i)) {
				out = append(out, i)
			}
		}
		return out
	}
	identity := func(k string) bool { return k == transformers.ProviderIdentity }
	var rules []int
	if r.Provider == transformers.ProviderKMSv2 {
		rules = pick(func(k string) bool {
			return isLocal(k) || k == transformers.ProviderKMSv2 || (len(r.Resources) > 0 && identity(k))
		})
		if len(rules) == 0 {
			// First-time encryption straight to a KMS plugin, as with a local type.
			rules = pick(identity)
		}
		if len(rules) > 1 {
			return nil, fmt.Errorf("--provider kms would rotate %d rules (%s), but a KMS v2 provider name may appear only once in a configuration; choose one with --resources and run rotate once per rule with its own --kms-name", len(rules), ruleNames(f.versioned, rules))
		}
	} else {
		rules = pick(isLocal)
		if len(rules) == 0 && r.Provider != "" {
			rules = pick(identity)
		}
	}
	if len(rules) == 0 {
		what := "writes with a local key (aesgcm, aescbc or secretbox)"
		if r.Provider == transformers.ProviderKMSv2 {
			what = "writes with a local key, KMS v2 or identity"
		}
		if r.Provider == "" {
			what += "; to encrypt for the first time, pass --provider aesgcm"
		}
		if len(r.Resources) > 0 {
			return nil, fmt.Errorf("no rule naming %s %s", strings.Join(r.Resources, ", "), what)
		}
		return nil, fmt.Errorf("no rule in the configuration %s", what)
	}
	return rules, nil
}

// writeType is the provider rule i writes with ("" for a rule without providers).
func (f *File) writeType(i int) string {
	if items := f.rules[i].Items; len(items) > 0 {
		return items[0].Provider
	}
	return ""
}

// writeKeyName names rule i's write key as Remove takes it: the local key's or KMS
// provider's name, or "identity".
func (f *File) writeKeyName(i int) string {
	items := f.rules[i].Items
	switch {
	case len(items) == 0:
		return ""
	case items[0].Provider == transformers.ProviderIdentity:
		return transformers.ProviderIdentity
	}
	return items[0].Name
}

// names lists every local key name and KMS provider name in f.
func (f *File) names() (keys, kms []string) {
	for _, e := range f.rules {
		for _, k := range e.Items {
			switch {
			case isLocal(k.Provider):
				keys = append(keys, k.Name)
			case k.Provider == transformers.ProviderKMSv2 || k.Provider == transformers.ProviderKMSv1:
				// KMS v1 names count too: upstream wants every KMS provider name unique.
				kms = append(kms, k.Name)
			}
		}
	}
	return keys, kms
}

func isLocal(kind string) bool {
	return kind == transformers.ProviderAESGCM || kind == transformers.ProviderAESCBC || kind == transformers.ProviderSecretbox
}

// namesAny reports whether a rule naming ruleResources names one of resources as
// written in the file (any rule when resources is empty): the --resources filter of both
// edits.
func namesAny(ruleResources, resources []string) bool {
	if len(resources) == 0 {
		return true
	}
	for _, want := range resources {
		if slices.Contains(ruleResources, want) {
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

// keyNameRandomBytes is the random part of a generated key name: 5 bytes, 8 base32
// characters, 40 bits. Parallel rotations of separate files (one per apiserver, an
// ansible loop, two operators in the same second) must not give the same name to
// different secrets: the cluster layer tells keys apart by name and check value, and
// a shared name hides which apiserver holds which secret. Fixed length, so no generated
// name is a prefix of another.
const keyNameRandomBytes = 5

// newKeyName is "key-<UTC time>-<8 random base32 characters>" (lowercase, no ':'), the
// random part read from random. When another key name equals it, starts with it or is
// a start of it, it is generated again a second later: a key name that is a prefix of
// another makes one key's stored prefix a prefix of the other's once a ':' is involved,
// and reading then depends on try order (see transformers' chain). An older name of
// the form "key-<UTC time>" is a start of every name generated in its second, so the
// time moves on rather than only the random part.
func newKeyName(now time.Time, existing []string, random io.Reader) (string, error) {
	const layout = "key-20060102T150405Z"
	clash := func(n string) bool {
		for _, e := range existing {
			if strings.HasPrefix(e, n) || strings.HasPrefix(n, e) {
				return true
			}
		}
		return false
	}
	suffix := make([]byte, keyNameRandomBytes)
	for i := range 1000 {
		if _, err := io.ReadFull(random, suffix); err != nil {
			return "", fmt.Errorf("generating a key name: %w", err)
		}
		// 5 bytes are exactly 8 base32 characters: no padding.
		name := now.UTC().Add(time.Duration(i)*time.Second).Format(layout) + "-" + strings.ToLower(base32.StdEncoding.EncodeToString(suffix))
		if !clash(name) {
			return name, nil
		}
	}
	return "", fmt.Errorf("every key name rotate can generate clashes with an existing name (equal, or one a prefix of the other); rename the keys named like %q", now.UTC().Format(layout))
}

// keysOf and setKeys read and replace a local provider's key list (nil and no-op for
// identity and KMS): the edits change the versioned object, which Describe does not
// cover.
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
