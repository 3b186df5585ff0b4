package shim

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/duration"

	"github.com/rekey-io/rekey/api/v1alpha1"
)

// tableConvertor renders `kubectl get` output with kube-apiserver's columns.
type tableConvertor struct {
	columns []metav1.TableColumnDefinition
	cells   func(obj runtime.Object) ([]any, error)
}

var (
	nameColumn = metav1.TableColumnDefinition{Name: "Name", Type: "string", Format: "name",
		Description: "Name must be unique within a namespace."}
	ageColumn = metav1.TableColumnDefinition{Name: "Age", Type: "string",
		Description: "Time since the object was created."}
	dataColumn = metav1.TableColumnDefinition{Name: "Data", Type: "string",
		Description: "Number of keys in the object's data."}

	secretTable = tableConvertor{
		columns: []metav1.TableColumnDefinition{nameColumn,
			{Name: "Type", Type: "string", Description: "Used to facilitate programmatic handling of secret data."},
			dataColumn, ageColumn},
		cells: func(obj runtime.Object) ([]any, error) {
			s, ok := obj.(*corev1.Secret)
			if !ok {
				return nil, fmt.Errorf("not a secret: %T", obj)
			}
			return []any{s.Name, string(s.Type), int64(len(s.Data)), age(s.CreationTimestamp)}, nil
		},
	}
	configMapTable = tableConvertor{
		columns: []metav1.TableColumnDefinition{nameColumn, dataColumn, ageColumn},
		cells: func(obj runtime.Object) ([]any, error) {
			c, ok := obj.(*corev1.ConfigMap)
			if !ok {
				return nil, fmt.Errorf("not a configmap: %T", obj)
			}
			return []any{c.Name, int64(len(c.Data) + len(c.BinaryData)), age(c.CreationTimestamp)}, nil
		},
	}
)

// encryptionStateTable has the columns of the distribution's CustomResourceDefinition
// (api/v1alpha1/encryptionstate-crd.yaml), so `kubectl get encryptionstates` reads the
// same on both.
var encryptionStateTable = tableConvertor{
	columns: []metav1.TableColumnDefinition{nameColumn,
		{Name: "Objects", Type: "integer", Description: "Stored objects of every resource counted."},
		{Name: "Plaintext", Type: "integer", Description: "Objects stored without encryption."},
		{Name: "Stale", Type: "integer", Description: "Readable objects not on their resource's write key."},
		{Name: "Unreadable", Type: "integer", Description: "Objects the configuration cannot read."},
		{Name: "FIPS", Type: "string", Description: "The writer's FIPS 140-3 mode."},
		{Name: "Observed-By", Type: "string", Description: "The apiserver that wrote the state."},
		ageColumn},
	cells: func(obj runtime.Object) ([]any, error) {
		e, ok := obj.(*v1alpha1.EncryptionState)
		if !ok {
			return nil, fmt.Errorf("not an encryptionstate: %T", obj)
		}
		t := e.Status.Totals
		return []any{e.Name, t.Objects, t.Plaintext, t.Stale, t.Unreadable, e.Status.FIPS, e.Status.ObservedBy, age(e.CreationTimestamp)}, nil
	},
}

func age(t metav1.Time) string {
	if t.IsZero() {
		return "<unknown>"
	}
	return duration.HumanDuration(time.Since(t.Time))
}

func (t tableConvertor) ConvertToTable(_ context.Context, object runtime.Object, tableOptions runtime.Object) (*metav1.Table, error) {
	table := &metav1.Table{}
	if opts, ok := tableOptions.(*metav1.TableOptions); !ok || !opts.NoHeaders {
		table.ColumnDefinitions = t.columns
	}
	addRow := func(obj runtime.Object) error {
		cells, err := t.cells(obj)
		if err != nil {
			return err
		}
		table.Rows = append(table.Rows, metav1.TableRow{Cells: cells, Object: runtime.RawExtension{Object: obj}})
		return nil
	}
	if meta.IsListType(object) {
		if err := meta.EachListItem(object, addRow); err != nil {
			return nil, err
		}
		if l, err := meta.ListAccessor(object); err == nil {
			table.ResourceVersion = l.GetResourceVersion()
			table.Continue = l.GetContinue()
			table.RemainingItemCount = l.GetRemainingItemCount()
		}
		return table, nil
	}
	if err := addRow(object); err != nil {
		return nil, err
	}
	if m, err := meta.Accessor(object); err == nil {
		table.ResourceVersion = m.GetResourceVersion()
	}
	return table, nil
}
