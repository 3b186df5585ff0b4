package shim

import (
	"context"
	"fmt"
	"maps"
	"slices"

	corev1 "k8s.io/api/core/v1"
	apimachineryvalidation "k8s.io/apimachinery/pkg/api/validation"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/apiserver/pkg/registry/generic"
	"k8s.io/apiserver/pkg/registry/generic/registry"
	"k8s.io/apiserver/pkg/registry/rest"
	"k8s.io/apiserver/pkg/storage"
	"k8s.io/apiserver/pkg/storage/names"
)

// strategy is the create/update/delete policy of one core/v1 resource: namespaced,
// generated names allowed, validation as kube-apiserver's for the fields the shim
// serves (object metadata, data keys, total size, immutability).
type strategy struct {
	runtime.ObjectTyper
	names.NameGenerator
	validate       func(obj runtime.Object) field.ErrorList
	validateUpdate func(obj, old runtime.Object) field.ErrorList
}

func (strategy) NamespaceScoped() bool                                            { return true }
func (strategy) PrepareForCreate(context.Context, runtime.Object)                 {}
func (strategy) PrepareForUpdate(context.Context, runtime.Object, runtime.Object) {}
func (strategy) WarningsOnCreate(context.Context, runtime.Object) []string        { return nil }
func (strategy) WarningsOnUpdate(context.Context, runtime.Object, runtime.Object) []string {
	return nil
}
func (strategy) Canonicalize(runtime.Object)                   {}
func (strategy) AllowCreateOnUpdate(context.Context) bool      { return false }
func (strategy) AllowUnconditionalUpdate(context.Context) bool { return true }

func (s strategy) Validate(_ context.Context, obj runtime.Object) field.ErrorList {
	return s.validate(obj)
}

func (s strategy) ValidateUpdate(_ context.Context, obj, old runtime.Object) field.ErrorList {
	return append(s.validate(obj), s.validateUpdate(obj, old)...)
}

var metadataPath = field.NewPath("metadata")

func validateSecret(obj runtime.Object) field.ErrorList {
	s := obj.(*corev1.Secret)
	errs := apimachineryvalidation.ValidateObjectMeta(&s.ObjectMeta, true, apimachineryvalidation.NameIsDNSSubdomain, metadataPath)
	dataPath := field.NewPath("data")
	total := 0
	for _, k := range slices.Sorted(maps.Keys(s.Data)) {
		total += len(s.Data[k])
		for _, msg := range validation.IsConfigMapKey(k) {
			errs = append(errs, field.Invalid(dataPath.Key(k), k, msg))
		}
	}
	if total > corev1.MaxSecretSize {
		errs = append(errs, field.TooLong(dataPath, "", corev1.MaxSecretSize))
	}
	if s.Type == "" {
		errs = append(errs, field.Required(field.NewPath("type"), ""))
	}
	return errs
}

func validateSecretUpdate(obj, old runtime.Object) field.ErrorList {
	s, o := obj.(*corev1.Secret), old.(*corev1.Secret)
	errs := apimachineryvalidation.ValidateObjectMetaUpdate(&s.ObjectMeta, &o.ObjectMeta, metadataPath)
	if s.Type != o.Type {
		errs = append(errs, field.Invalid(field.NewPath("type"), s.Type, "field is immutable"))
	}
	if isTrue(o.Immutable) {
		if !isTrue(s.Immutable) {
			errs = append(errs, field.Forbidden(field.NewPath("immutable"), "field is immutable when `immutable` is set"))
		}
		if !maps.EqualFunc(s.Data, o.Data, func(a, b []byte) bool { return string(a) == string(b) }) {
			errs = append(errs, field.Forbidden(field.NewPath("data"), "field is immutable when `immutable` is set"))
		}
	}
	return errs
}

func validateConfigMap(obj runtime.Object) field.ErrorList {
	c := obj.(*corev1.ConfigMap)
	errs := apimachineryvalidation.ValidateObjectMeta(&c.ObjectMeta, true, apimachineryvalidation.NameIsDNSSubdomain, metadataPath)
	total := 0
	dataPath, binaryPath := field.NewPath("data"), field.NewPath("binaryData")
	for _, k := range slices.Sorted(maps.Keys(c.Data)) {
		total += len(c.Data[k])
		for _, msg := range validation.IsConfigMapKey(k) {
			errs = append(errs, field.Invalid(dataPath.Key(k), k, msg))
		}
	}
	for _, k := range slices.Sorted(maps.Keys(c.BinaryData)) {
		total += len(c.BinaryData[k])
		for _, msg := range validation.IsConfigMapKey(k) {
			errs = append(errs, field.Invalid(binaryPath.Key(k), k, msg))
		}
		if _, dup := c.Data[k]; dup {
			errs = append(errs, field.Invalid(binaryPath.Key(k), k, "duplicate of key present in data"))
		}
	}
	if total > corev1.MaxSecretSize {
		errs = append(errs, field.TooLong(field.NewPath(""), "", corev1.MaxSecretSize))
	}
	return errs
}

func validateConfigMapUpdate(obj, old runtime.Object) field.ErrorList {
	c, o := obj.(*corev1.ConfigMap), old.(*corev1.ConfigMap)
	errs := apimachineryvalidation.ValidateObjectMetaUpdate(&c.ObjectMeta, &o.ObjectMeta, metadataPath)
	if isTrue(o.Immutable) {
		if !isTrue(c.Immutable) {
			errs = append(errs, field.Forbidden(field.NewPath("immutable"), "field is immutable when `immutable` is set"))
		}
		if !maps.Equal(c.Data, o.Data) {
			errs = append(errs, field.Forbidden(field.NewPath("data"), "field is immutable when `immutable` is set"))
		}
		if !maps.EqualFunc(c.BinaryData, o.BinaryData, func(a, b []byte) bool { return string(a) == string(b) }) {
			errs = append(errs, field.Forbidden(field.NewPath("binaryData"), "field is immutable when `immutable` is set"))
		}
	}
	return errs
}

func isTrue(b *bool) bool { return b != nil && *b }

// secretAttrs adds the `type` field selector kube-apiserver supports for secrets.
func secretAttrs(obj runtime.Object) (labels.Set, fields.Set, error) {
	s, ok := obj.(*corev1.Secret)
	if !ok {
		return nil, nil, fmt.Errorf("not a secret: %T", obj)
	}
	f := generic.ObjectMetaFieldsSet(&s.ObjectMeta, true)
	f["type"] = string(s.Type)
	return s.Labels, f, nil
}

// withShortNames adds short names (kubectl get cm) to a store.
type withShortNames struct {
	*registry.Store
	shortNames []string
}

var _ rest.ShortNamesProvider = withShortNames{}

func (w withShortNames) ShortNames() []string { return w.shortNames }

// newStores builds the registry stores of secrets and configmaps on getter.
func newStores(sch *apiScheme, getter generic.RESTOptionsGetter) (map[string]rest.Storage, error) {
	secretStrategy := strategy{ObjectTyper: sch.scheme, NameGenerator: names.SimpleNameGenerator,
		validate: validateSecret, validateUpdate: validateSecretUpdate}
	secrets := &registry.Store{
		NewFunc:                   func() runtime.Object { return &corev1.Secret{} },
		NewListFunc:               func() runtime.Object { return &corev1.SecretList{} },
		DefaultQualifiedResource:  corev1.Resource("secrets"),
		SingularQualifiedResource: corev1.Resource("secret"),
		CreateStrategy:            secretStrategy,
		UpdateStrategy:            secretStrategy,
		DeleteStrategy:            secretStrategy,
		TableConvertor:            secretTable,
	}
	if err := secrets.CompleteWithOptions(&generic.StoreOptions{RESTOptions: getter, AttrFunc: secretAttrs}); err != nil {
		return nil, fmt.Errorf("secrets storage: %w", err)
	}

	cmStrategy := strategy{ObjectTyper: sch.scheme, NameGenerator: names.SimpleNameGenerator,
		validate: validateConfigMap, validateUpdate: validateConfigMapUpdate}
	configMaps := &registry.Store{
		NewFunc:                   func() runtime.Object { return &corev1.ConfigMap{} },
		NewListFunc:               func() runtime.Object { return &corev1.ConfigMapList{} },
		DefaultQualifiedResource:  corev1.Resource("configmaps"),
		SingularQualifiedResource: corev1.Resource("configmap"),
		CreateStrategy:            cmStrategy,
		UpdateStrategy:            cmStrategy,
		DeleteStrategy:            cmStrategy,
		TableConvertor:            configMapTable,
	}
	if err := configMaps.CompleteWithOptions(&generic.StoreOptions{RESTOptions: getter, AttrFunc: storage.DefaultNamespaceScopedAttr}); err != nil {
		secrets.DestroyFunc()
		return nil, fmt.Errorf("configmaps storage: %w", err)
	}
	return map[string]rest.Storage{
		"secrets":    secrets,
		"configmaps": withShortNames{Store: configMaps, shortNames: []string{"cm"}},
	}, nil
}
