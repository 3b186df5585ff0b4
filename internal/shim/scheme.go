package shim

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"

	"github.com/rekey-io/rekey/api/v1alpha1"
)

// internalVersion is the hub version the generic handlers decode into.
var internalVersion = schema.GroupVersion{Group: "", Version: runtime.APIVersionInternal}

// apiScheme holds the scheme and codecs of one server. kube-apiserver converts core/v1
// to internal types that live in k8s.io/kubernetes; the shim instead registers the v1
// Go types as the internal version too, so the scheme "converts" by setting the kind and
// no conversion functions are needed. The defaulting kube does in conversion (Secret
// stringData folded into data) is a defaulting function here, which runs on decode.
type apiScheme struct {
	scheme *runtime.Scheme
	codecs serializer.CodecFactory
}

func newAPIScheme() (*apiScheme, error) {
	s := runtime.NewScheme()
	if err := corev1.AddToScheme(s); err != nil {
		return nil, err
	}
	s.AddKnownTypes(internalVersion,
		&corev1.Secret{}, &corev1.SecretList{},
		&corev1.ConfigMap{}, &corev1.ConfigMapList{},
	)
	metav1.AddToGroupVersion(s, corev1.SchemeGroupVersion)
	unversioned := schema.GroupVersion{Group: "", Version: "v1"}
	s.AddUnversionedTypes(unversioned,
		&metav1.Status{}, &metav1.APIVersions{}, &metav1.APIGroupList{},
		&metav1.APIGroup{}, &metav1.APIResourceList{},
	)
	// rekey.io/v1alpha1 (the EncryptionState the layer publishes), its Go types as
	// its internal version too, as for core/v1.
	if err := v1alpha1.AddToScheme(s); err != nil {
		return nil, err
	}
	s.AddKnownTypes(schema.GroupVersion{Group: v1alpha1.Group, Version: runtime.APIVersionInternal},
		&v1alpha1.EncryptionState{}, &v1alpha1.EncryptionStateList{})
	if err := s.SetVersionPriority(v1alpha1.SchemeGroupVersion); err != nil {
		return nil, err
	}
	s.AddTypeDefaultingFunc(&corev1.Secret{}, func(obj any) { defaultSecret(obj.(*corev1.Secret)) })
	// Field selectors kube-apiserver accepts for secrets: the metadata ones and type.
	if err := s.AddFieldLabelConversionFunc(corev1.SchemeGroupVersion.WithKind("Secret"), func(label, value string) (string, string, error) {
		switch label {
		case "metadata.name", "metadata.namespace", "type":
			return label, value, nil
		}
		return "", "", fmt.Errorf("field label not supported: %s", label)
	}); err != nil {
		return nil, err
	}
	return &apiScheme{scheme: s, codecs: serializer.NewCodecFactory(s)}, nil
}

// defaultSecret does what kube-apiserver does between the wire and storage: stringData
// is write-only and merged over data, and the type defaults to Opaque.
func defaultSecret(s *corev1.Secret) {
	if s.Type == "" {
		s.Type = corev1.SecretTypeOpaque
	}
	if len(s.StringData) == 0 {
		return
	}
	if s.Data == nil {
		s.Data = make(map[string][]byte, len(s.StringData))
	}
	for k, v := range s.StringData {
		s.Data[k] = []byte(v)
	}
	s.StringData = nil
}
