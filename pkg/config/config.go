// Package config reads, hashes, strictly decodes, defaults and validates an
// EncryptionConfiguration file exactly as kube-apiserver does, using the types and
// validation from k8s.io/apiserver, and additionally rejects at validation time what
// upstream only discovers while building transformers (masked wildcard rules) and what
// rekey does not do (write with KMS v1: it only reads KMS v1 values).
//
// Nothing in this package prints key material: errors carry the file name, the field
// path or line and what is wrong, never a value from under `providers` (see redact.go).
package config

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/apiserver/pkg/apis/apiserver"
	apiserverv1 "k8s.io/apiserver/pkg/apis/apiserver/v1"
	"k8s.io/apiserver/pkg/apis/apiserver/validation"
)

// HashPrefix starts every content hash, as in upstream's last_config_info metric.
const HashPrefix = "sha256:"

// KMSv1ReadOnlyError is why a KMS v1 provider may not be first in a resource's
// providers. rekey reads KMS v1 values, so clusters created before KMS v2 can migrate
// off it, and never writes them. Upstream's refusal (KMSv1 feature gate off) sends the
// operator to --feature-gates=KMSv1=true, which no rekey binary has or needs; these
// words say what to do instead.
const KMSv1ReadOnlyError = "KMS v1 can only be read: put a KMS v2 provider (apiVersion: v2) or a local key (aesgcm, aescbc, secretbox) first, keep the KMS v1 provider after it so existing values stay readable, then run `rekey rotate` or `rekey migrate` to move its values to the new key"

// Config is a loaded, defaulted and validated encryption configuration.
type Config struct {
	// Source names where the bytes came from (normally the file path); used in errors.
	Source string
	// Hash is "sha256:<hex>" of the raw bytes, identical to upstream's content hash.
	Hash string
	// Encryption is the defaulted internal object. It holds key material: never log it.
	Encryption *apiserver.EncryptionConfiguration
}

// Options change how a configuration is validated.
type Options struct {
	// Reload mirrors upstream's reload argument: when true, KMS v1 provider names must be
	// unique too (v2 names always must be). An agent that reloads passes true.
	Reload bool
}

// decoder is immutable after construction; it is built once because building a scheme is
// comparatively expensive and it carries no state between calls.
var decoder = newDecoder()

func newDecoder() runtime.Decoder {
	scheme := runtime.NewScheme()
	utilruntime.Must(apiserver.AddToScheme(scheme))
	utilruntime.Must(apiserverv1.AddToScheme(scheme))
	return serializer.NewCodecFactory(scheme, serializer.EnableStrict).UniversalDecoder()
}

// Hash returns "sha256:<lower-case hex>" of data, upstream's content hash.
func Hash(data []byte) string {
	sum := sha256.Sum256(data)
	return HashPrefix + hex.EncodeToString(sum[:])
}

// MaxFileSize bounds the configuration file ReadFile accepts: 1 MiB. kube-apiserver's
// encryption configurations are a few KiB (a key is one line); a file this large is not
// one, and reading it whole while the reload lock is held would stall every reload.
const MaxFileSize = 1 << 20

// ReadFile reads path and returns its bytes and hash. An empty file is an error: a
// half-written file (truncated before the new content arrived) must never replace a
// working configuration. Only regular files (or symlinks to one, as kubelet mounts
// them) of at most MaxFileSize bytes are read: a FIFO would block the reader, and a
// device or an endless file would never end.
func ReadFile(path string) ([]byte, string, error) {
	f, err := openNonBlocking(path)
	if err != nil {
		return nil, "", fmt.Errorf("error reading encryption provider configuration file %q: %w", path, err)
	}
	defer f.Close()
	// Checked on the open file, not the path, so a swap between a check and the open
	// cannot slip a FIFO or device in.
	fi, err := f.Stat()
	if err != nil {
		return nil, "", fmt.Errorf("error reading encryption provider configuration file %q: %w", path, err)
	}
	if !fi.Mode().IsRegular() {
		return nil, "", fmt.Errorf("encryption provider configuration file %q is not a regular file (it is a %s); point the flag at a file or a symlink to one", path, fileKind(fi.Mode()))
	}
	data, err := io.ReadAll(io.LimitReader(f, MaxFileSize+1))
	if err != nil {
		return nil, "", fmt.Errorf("error reading encryption provider configuration file %q: %w", path, err)
	}
	if len(data) > MaxFileSize {
		return nil, "", fmt.Errorf("encryption provider configuration file %q is larger than %d bytes (1 MiB), far more than any encryption configuration needs; check that the flag names the right file", path, MaxFileSize)
	}
	if len(data) == 0 {
		return nil, "", fmt.Errorf("encryption provider configuration file %q is empty", path)
	}
	return data, Hash(data), nil
}

func fileKind(m fs.FileMode) string {
	switch {
	case m.IsDir():
		return "directory"
	case m&fs.ModeNamedPipe != 0:
		return "named pipe (FIFO)"
	case m&fs.ModeSocket != 0:
		return "socket"
	case m&fs.ModeCharDevice != 0:
		return "character device"
	case m&fs.ModeDevice != 0:
		return "device"
	default:
		return "special file (" + m.Type().String() + ")"
	}
}

// Load reads, decodes, defaults and validates the file at path.
func Load(path string, opts Options) (*Config, error) {
	data, _, err := ReadFile(path)
	if err != nil {
		return nil, err
	}
	return Parse(data, path, opts)
}

// Parse decodes, defaults and validates data. source names the data in errors.
func Parse(data []byte, source string, opts Options) (*Config, error) {
	if len(data) == 0 {
		return nil, fmt.Errorf("encryption provider configuration file %q is empty", source)
	}
	obj, gvk, err := decoder.Decode(data, nil, nil)
	if err != nil {
		// Decoder errors can quote the input, keys included (the missing kind/version
		// errors quote all of it), so none is passed on as it is.
		var msg string
		switch {
		case runtime.IsMissingKind(err):
			msg = "Object 'Kind' is missing"
		case runtime.IsMissingVersion(err):
			msg = "Object 'apiVersion' is missing"
		default:
			msg = DescribeDecodeError(err, "EncryptionConfiguration")
		}
		return nil, fmt.Errorf("error decoding encryption provider configuration file %q: %s", source, msg)
	}
	enc, ok := obj.(*apiserver.EncryptionConfiguration)
	if !ok {
		return nil, fmt.Errorf("error decoding encryption provider configuration file %q: got unexpected config type: %v", source, gvk)
	}
	errs := validation.ValidateEncryptionConfiguration(enc, opts.Reload)
	if len(errs) == 0 {
		// The checks below assume a structurally valid config (parsable resource names).
		errs = append(errs, validateMasking(enc)...)
		errs = append(errs, validateKMSv1ReadOnly(enc)...)
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("invalid encryption provider configuration file %q: %w", source, redactErrors(errs).ToAggregate())
	}
	return &Config{Source: source, Hash: Hash(data), Encryption: enc}, nil
}

var anyGroupAnyResource = schema.GroupResource{Group: "*", Resource: "*"}

// validateMasking reports a resource rule that an earlier `*.group` or `*.*` rule (in an
// earlier resources entry) already covers. Upstream only finds this while constructing
// transformers; the words are the same.
func validateMasking(c *apiserver.EncryptionConfiguration) field.ErrorList {
	var errs field.ErrorList
	seen := map[schema.GroupResource]bool{}
	for i, rc := range c.Resources {
		path := field.NewPath("resources").Index(i).Child("resources")
		for j, r := range rc.Resources {
			gr := schema.ParseGroupResource(r)
			groupWildcard := schema.GroupResource{Group: gr.Group, Resource: "*"}
			switch {
			case seen[groupWildcard]:
				errs = append(errs, field.Invalid(path.Index(j), r, fmt.Sprintf("resource %q is masked by earlier rule %q", GroupResourceString(gr), GroupResourceString(groupWildcard))))
			case seen[anyGroupAnyResource]:
				errs = append(errs, field.Invalid(path.Index(j), r, fmt.Sprintf("resource %q is masked by earlier rule %q", GroupResourceString(gr), GroupResourceString(anyGroupAnyResource))))
			}
		}
		// Rules of one entry only mask later entries (overlap inside an entry is
		// validated upstream), so they are recorded after the entry is checked.
		for _, r := range rc.Resources {
			seen[schema.ParseGroupResource(r)] = true
		}
	}
	return errs
}

// validateKMSv1ReadOnly reports a KMS v1 provider in the write position: first in the
// providers of the first entry that names a resource (a later entry naming the same
// resource only appends readers). Behind a provider that writes it is valid: rekey
// reads it.
func validateKMSv1ReadOnly(c *apiserver.EncryptionConfiguration) field.ErrorList {
	var errs field.ErrorList
	named := map[schema.GroupResource]bool{}
	for i, rc := range c.Resources {
		writes := false
		for _, r := range rc.Resources {
			gr := schema.ParseGroupResource(r)
			writes = writes || !named[gr]
			named[gr] = true
		}
		if writes && len(rc.Providers) > 0 && rc.Providers[0].KMS != nil && rc.Providers[0].KMS.APIVersion == "v1" {
			path := field.NewPath("resources").Index(i).Child("providers").Index(0).Child("kms", "apiVersion")
			errs = append(errs, field.Invalid(path, "v1", KMSv1ReadOnlyError))
		}
	}
	return errs
}

// GroupResourceString renders a group resource as it is written in the config file
// (`*.` for all core resources), matching upstream's messages.
func GroupResourceString(gr schema.GroupResource) string {
	if gr.Group == "" && gr.Resource == "*" {
		return "*."
	}
	return gr.String()
}
