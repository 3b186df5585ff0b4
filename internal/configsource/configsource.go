// Package configsource reads and replaces an encryption configuration where it is
// kept: a file the apiservers read (cmd/rekey implements that one, under its edit
// lock), or one key of a Secret that a platform projects into every apiserver's pod
// (Secret, here). A replacement is a compare-and-swap against the version that was
// read — the file's content hash, the Secret's resourceVersion — so an edit decided on
// one version never silently overwrites a newer one.
package configsource

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"

	"github.com/rekey-io/rekey/pkg/config"
)

// Source is where the configuration is kept.
type Source interface {
	// String names the source in messages ("/etc/kubernetes/enc.yaml",
	// "secret kube-system/encryption-config key config.yaml").
	String() string
	// Read returns the configuration's bytes and the version they are at.
	Read(ctx context.Context) (data []byte, version string, err error)
	// Replace stores data provided the source is still at version; otherwise it
	// stores nothing and returns an error wrapping ErrChanged.
	Replace(ctx context.Context, version string, data []byte) error
}

// ErrChanged: the source is no longer at the version the edit was decided on (another
// rotate, a person, a pipeline or a controller wrote it in between).
var ErrChanged = errors.New("the configuration changed since it was read")

// SecretRef names the key of a Secret that holds the configuration.
type SecretRef struct {
	Namespace, Name string
	// Key is the data key; empty: the Secret's only key.
	Key string
}

func (r SecretRef) String() string {
	s := "secret " + r.Namespace + "/" + r.Name
	if r.Key != "" {
		s += " key " + r.Key
	}
	return s
}

// ParseSecretRef parses NAMESPACE/NAME[:KEY] (the --secret flag).
func ParseSecretRef(s string) (SecretRef, error) {
	var r SecretRef
	ref, key, hasKey := strings.Cut(s, ":")
	ns, name, ok := strings.Cut(ref, "/")
	if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
		return r, fmt.Errorf("--secret %q: want NAMESPACE/NAME or NAMESPACE/NAME:KEY (the key of the Secret's data that holds the EncryptionConfiguration)", s)
	}
	if errs := validation.IsDNS1123Label(ns); len(errs) > 0 {
		return r, fmt.Errorf("--secret %q: namespace %q: %s", s, ns, strings.Join(errs, "; "))
	}
	if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
		return r, fmt.Errorf("--secret %q: name %q: %s", s, name, strings.Join(errs, "; "))
	}
	if hasKey {
		if errs := validation.IsConfigMapKey(key); len(errs) > 0 {
			return r, fmt.Errorf("--secret %q: key %q: %s", s, key, strings.Join(errs, "; "))
		}
	}
	return SecretRef{Namespace: ns, Name: name, Key: key}, nil
}

// Secret is the configuration kept in one key of a Secret, read and replaced through
// the Kubernetes API: the version is the Secret's resourceVersion, and Replace is an
// update carrying it, so the API server refuses it when anything changed the Secret
// meanwhile. The Secret's other keys, labels and annotations are kept.
type Secret struct {
	Client corev1client.SecretsGetter
	Ref    SecretRef
}

func (s Secret) String() string { return s.Ref.String() }

// Read returns the configuration's bytes and the Secret's resourceVersion.
func (s Secret) Read(ctx context.Context) ([]byte, string, error) {
	sec, key, err := s.get(ctx)
	if err != nil {
		return nil, "", err
	}
	return sec.Data[key], sec.ResourceVersion, nil
}

// Replace updates the key with data, provided the Secret is still at version.
func (s Secret) Replace(ctx context.Context, version string, data []byte) error {
	if len(data) > config.MaxFileSize {
		return fmt.Errorf("%s: the configuration is %d bytes, more than the %d an apiserver reads", s, len(data), config.MaxFileSize)
	}
	sec, key, err := s.get(ctx)
	if err != nil {
		return err
	}
	if sec.ResourceVersion != version {
		return fmt.Errorf("%s is at resourceVersion %s, not %s: %w", s, sec.ResourceVersion, version, ErrChanged)
	}
	next := sec.DeepCopy()
	next.Data = maps.Clone(sec.Data)
	next.Data[key] = data
	_, err = s.Client.Secrets(s.Ref.Namespace).Update(ctx, next, metav1.UpdateOptions{FieldManager: "rekey"})
	if apierrors.IsConflict(err) {
		return fmt.Errorf("%s was updated by someone else meanwhile: %w", s, ErrChanged)
	}
	if err != nil {
		return fmt.Errorf("updating %s: %w", s, err)
	}
	return nil
}

// get reads the Secret and picks the configuration's key.
func (s Secret) get(ctx context.Context) (*corev1.Secret, string, error) {
	sec, err := s.Client.Secrets(s.Ref.Namespace).Get(ctx, s.Ref.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, "", fmt.Errorf("%s: not found (create it with the configuration the apiservers run, or check the namespace and name)", s)
	}
	if apierrors.IsForbidden(err) {
		return nil, "", fmt.Errorf("%s: the API server refuses to let rekey read it (it needs get and update on this Secret): %w", s, err)
	}
	if err != nil {
		return nil, "", fmt.Errorf("reading %s: %w", s, err)
	}
	key := s.Ref.Key
	if key == "" {
		if len(sec.Data) != 1 {
			return nil, "", fmt.Errorf("%s has %d data keys (%s): name the one with the configuration, --secret %s/%s:KEY",
				s, len(sec.Data), strings.Join(slices.Sorted(maps.Keys(sec.Data)), ", "), s.Ref.Namespace, s.Ref.Name)
		}
		for k := range sec.Data {
			key = k
		}
	}
	if _, ok := sec.Data[key]; !ok {
		return nil, "", fmt.Errorf("%s has no data key %q (its keys: %s)", s, key, strings.Join(slices.Sorted(maps.Keys(sec.Data)), ", "))
	}
	return sec, key, nil
}
