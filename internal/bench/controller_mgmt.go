package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"github.com/rekey-io/rekey/api/v1alpha1"
	"github.com/rekey-io/rekey/internal/testbed"
)

// The controller scenario's management API, shared by both sides: dist/kube-apiserver
// on an etcd process of its own, with the ControlPlaneEncryption CRD installed. It
// holds each side's configuration Secret (which the projector copies into the hosted
// apiservers' files) and, on rekey's side, the object the controller reconciles.

// mgmtNamespace holds the Secrets and the objects.
const mgmtNamespace = "default"

// mgmtConfigKey is the data key of the configuration in each side's Secret.
const mgmtConfigKey = "config.yaml"

type mgmtAPI struct {
	etcd   *testbed.Etcd
	server *testbed.Shim
	kube   kubernetes.Interface
	cpes   dynamic.ResourceInterface
}

// startMgmtAPI starts kapiBin (dist/kube-apiserver) on its own etcd and installs the
// CRD.
func startMgmtAPI(ctx context.Context, progress io.Writer, dir string, bins testbed.Binaries, kapiBin string) (*mgmtAPI, error) {
	// A local, not a named result: an error return must not leave the deferred stop
	// a nil mgmtAPI (and etcd and the server running).
	m := &mgmtAPI{}
	var err error
	defer func() {
		if err != nil {
			m.stop()
		}
	}()
	start := time.Now()
	if m.etcd, err = testbed.StartEtcd(ctx, bins.Etcd, filepath.Join(dir, "mgmt-etcd")); err != nil {
		return nil, err
	}
	if m.server, err = testbed.StartKubeAPIServer(ctx, kapiBin, testbed.KubeAPIServerConfig{Name: "management", Dir: filepath.Join(dir, "mgmt"),
		EtcdServers: []string{m.etcd.Endpoint}, EtcdPrefix: "/management"}); err != nil {
		return nil, err
	}
	if m.kube, err = kubernetes.NewForConfig(m.server.RESTConfig()); err != nil {
		return nil, err
	}
	var dyn *dynamic.DynamicClient
	if dyn, err = dynamic.NewForConfig(m.server.RESTConfig()); err != nil {
		return nil, err
	}
	if err = installCRD(ctx, dyn); err != nil {
		return nil, err
	}
	m.cpes = dyn.Resource(v1alpha1.GroupVersionResource()).Namespace(mgmtNamespace)
	fmt.Fprintf(progress, "controller: management API ready with the CRD in %v\n", time.Since(start).Round(time.Millisecond))
	return m, nil
}

func (m *mgmtAPI) stop() {
	if m.server != nil {
		m.server.Stop(30 * time.Second)
	}
	if m.etcd != nil {
		m.etcd.Stop(10 * time.Second)
	}
}

var crdResource = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// installCRD creates deploy/controller/crd.yaml and waits until it is established.
func installCRD(ctx context.Context, dyn dynamic.Interface) error {
	root, err := testbed.ModuleRoot()
	if err != nil {
		return err
	}
	raw, err := os.ReadFile(filepath.Join(root, "deploy", "controller", "crd.yaml"))
	if err != nil {
		return err
	}
	js, err := yaml.YAMLToJSON(raw)
	if err != nil {
		return fmt.Errorf("deploy/controller/crd.yaml: %w", err)
	}
	u := &unstructured.Unstructured{}
	if err := u.UnmarshalJSON(js); err != nil {
		return fmt.Errorf("deploy/controller/crd.yaml: %w", err)
	}
	crds := dyn.Resource(crdResource)
	if _, err := crds.Create(ctx, u, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("installing the CRD: %w", err)
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		got, err := crds.Get(ctx, u.GetName(), metav1.GetOptions{})
		if err == nil && crdEstablished(got) {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the CRD %s is not established after 60 s (%v)", u.GetName(), err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	// Established in the CRD's status may run ahead of the resource being served.
	res := dyn.Resource(v1alpha1.GroupVersionResource()).Namespace(mgmtNamespace)
	for {
		_, err := res.List(ctx, metav1.ListOptions{Limit: 1})
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("listing %s: %w", v1alpha1.Resource, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func crdEstablished(u *unstructured.Unstructured) bool {
	conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
	for _, c := range conds {
		m, ok := c.(map[string]any)
		if ok && m["type"] == "Established" && m["status"] == "True" {
			return true
		}
	}
	return false
}

// createConfigSecret creates the Secret name holding content under mgmtConfigKey.
func (m *mgmtAPI) createConfigSecret(ctx context.Context, name string, content []byte) error {
	_, err := m.kube.CoreV1().Secrets(mgmtNamespace).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name},
		Data: map[string][]byte{mgmtConfigKey: content}}, metav1.CreateOptions{})
	return err
}

// editConfigSecret replaces the configuration in the Secret name, as an operator or a
// platform's own controller edits it (an update with the resourceVersion read).
func (m *mgmtAPI) editConfigSecret(ctx context.Context, name string, content []byte) error {
	secrets := m.kube.CoreV1().Secrets(mgmtNamespace)
	for range 5 {
		s, err := secrets.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if s.Data == nil {
			s.Data = map[string][]byte{}
		}
		s.Data[mgmtConfigKey] = content
		if _, err = secrets.Update(ctx, s, metav1.UpdateOptions{}); !apierrors.IsConflict(err) {
			return err
		}
	}
	return fmt.Errorf("editing Secret %s: 5 conflicts in a row", name)
}

// configSecret reads the configuration in the Secret name.
func (m *mgmtAPI) configSecret(ctx context.Context, name string) ([]byte, error) {
	s, err := m.kube.CoreV1().Secrets(mgmtNamespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	return s.Data[mgmtConfigKey], nil
}

// createCPE creates the object.
func (m *mgmtAPI) createCPE(ctx context.Context, o *v1alpha1.ControlPlaneEncryption) error {
	obj, err := runtime.DefaultUnstructuredConverter.ToUnstructured(o)
	if err != nil {
		return err
	}
	u := &unstructured.Unstructured{Object: obj}
	u.SetAPIVersion(v1alpha1.SchemeGroupVersion.String())
	u.SetKind(v1alpha1.Kind)
	_, err = m.cpes.Create(ctx, u, metav1.CreateOptions{})
	return err
}

// getCPE reads the object name.
func (m *mgmtAPI) getCPE(ctx context.Context, name string) (*v1alpha1.ControlPlaneEncryption, error) {
	u, err := m.cpes.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	var o v1alpha1.ControlPlaneEncryption
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &o); err != nil {
		return nil, err
	}
	return &o, nil
}

// startController runs `rekey controller` against the management API, logging into
// dir; its metrics and probes are off (nothing here reads them).
func startController(dir, rekeyBin, kubeconfig string) (*testbed.Process, error) {
	return testbed.Start("rekey-controller", dir, rekeyBin, "controller", "--kubeconfig", kubeconfig,
		"--namespace", mgmtNamespace, "--leader-election-namespace", mgmtNamespace,
		"--metrics-bind-address", "0", "--health-probe-bind-address", "0")
}
