package main

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apiextensionsclient "k8s.io/apiextensions-apiserver/pkg/client/clientset/clientset/typed/apiextensions/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/kubernetes/pkg/api/legacyscheme"
	"sigs.k8s.io/yaml"

	"github.com/rekey-io/rekey/api/v1alpha1"
	"github.com/rekey-io/rekey/pkg/encryptionstate"
)

// crdStatePublisher publishes the cluster's EncryptionState as a custom resource
// (encryptionstate.Publisher): kube-apiserver serves custom resources through its
// apiextensions server, where discovery, RBAC, watches, kubectl's columns and the
// aggregator's APIService all come with the CustomResourceDefinition, so the layer
// installs the definition (api/v1alpha1's, the same schema the shim serves) and
// writes the object through the loopback client, as svm.go writes the
// StorageVersionMigrations. Users' writes never reach it: refuseStateWrites answers
// them in the outermost chain; only the apiserver's own loopback user may write.
type crdStatePublisher struct {
	crds apiextensionsclient.CustomResourceDefinitionInterface
	objs dynamic.ResourceInterface

	mu sync.Mutex
	// installed is set once the definition exists (created here or found).
	installed bool
}

func newCRDStatePublisher(loopback *rest.Config) (*crdStatePublisher, error) {
	ext, err := apiextensionsclient.NewForConfig(loopback)
	if err != nil {
		return nil, fmt.Errorf("encryption state: apiextensions client: %w", err)
	}
	dyn, err := dynamic.NewForConfig(loopback)
	if err != nil {
		return nil, fmt.Errorf("encryption state: dynamic client: %w", err)
	}
	return &crdStatePublisher{crds: ext.CustomResourceDefinitions(), objs: dyn.Resource(v1alpha1.EncryptionStateGroupVersionResource())}, nil
}

// Publish creates the definition when absent (an operator who deletes it gets it back
// at the next change), then the object or its new status, by compare-and-swap on its
// resourceVersion. Until the definition is established the object's calls fail with
// NotFound; the keeper retries at its next check.
func (p *crdStatePublisher) Publish(ctx context.Context, st v1alpha1.EncryptionStateStatus) (bool, error) {
	if err := p.ensureCRD(ctx); err != nil {
		return false, err
	}
	status, err := runtime.DefaultUnstructuredConverter.ToUnstructured(&st)
	if err != nil {
		return false, err
	}
	cur, err := p.objs.Get(ctx, v1alpha1.EncryptionStateName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		obj := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": v1alpha1.SchemeGroupVersion.String(), "kind": v1alpha1.EncryptionStateKind,
			"metadata": map[string]any{"name": v1alpha1.EncryptionStateName, "labels": map[string]any{svmManagedByLabel: svmManagedBy}},
			"status":   status,
		}}
		if _, err := p.objs.Create(ctx, obj, metav1.CreateOptions{FieldManager: svmManagedBy}); err != nil {
			p.forgetCRDIfGone(err)
			return false, err
		}
		return true, nil
	}
	if err != nil {
		p.forgetCRDIfGone(err)
		return false, err
	}
	var stored v1alpha1.EncryptionState
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(cur.Object, &stored); err == nil && equality.Semantic.DeepEqual(stored.Status, st) {
		return false, nil
	}
	cur.Object["status"] = status
	if _, err := p.objs.Update(ctx, cur, metav1.UpdateOptions{FieldManager: svmManagedBy}); err != nil {
		return false, err
	}
	return true, nil
}

func (p *crdStatePublisher) ensureCRD(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.installed {
		return nil
	}
	var crd apiextensionsv1.CustomResourceDefinition
	if err := yaml.UnmarshalStrict(v1alpha1.EncryptionStateCRD(), &crd); err != nil {
		return fmt.Errorf("encryption state: the built-in CustomResourceDefinition does not decode: %w", err)
	}
	_, err := p.crds.Create(ctx, &crd, metav1.CreateOptions{FieldManager: svmManagedBy})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("encryption state: creating CustomResourceDefinition %s: %w", crd.Name, err)
	}
	// The object's endpoint is served once the definition is established (a second
	// or so after it is created): wait for it here rather than fail the first publish.
	err = wait.PollUntilContextTimeout(ctx, crdPollInterval, crdEstablishTimeout, true, func(ctx context.Context) (bool, error) {
		got, err := p.crds.Get(ctx, crd.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, c := range got.Status.Conditions {
			if c.Type == apiextensionsv1.Established && c.Status == apiextensionsv1.ConditionTrue {
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("encryption state: CustomResourceDefinition %s is not established after %v; the next check retries", crd.Name, crdEstablishTimeout)
	}
	p.installed = true
	return nil
}

// How long ensureCRD waits for the definition to be established, and how often it looks.
const (
	crdEstablishTimeout = 5 * time.Second
	crdPollInterval     = 100 * time.Millisecond
)

// forgetCRDIfGone makes the next Publish look for the definition again after a NotFound.
func (p *crdStatePublisher) forgetCRDIfGone(err error) {
	if apierrors.IsNotFound(err) {
		p.mu.Lock()
		p.installed = false
		p.mu.Unlock()
	}
}

// refuseStateWrites answers users' writes of encryptionstates (405, with what to do):
// only the apiserver's loopback user, through which the migration leader publishes,
// may write them. It wraps the API handler inside the outermost chain, after
// authentication.
func refuseStateWrites(h http.Handler) http.Handler {
	return encryptionstate.RefuseWrites(h, legacyscheme.Codecs, func(u user.Info) bool { return u.GetName() == user.APIServerUser })
}
