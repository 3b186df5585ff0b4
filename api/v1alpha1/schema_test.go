package v1alpha1

import (
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// TestCRDSchemaMatchesTypes checks deploy/controller/crd.yaml against the Go types:
// every JSON field of the types is a property of the schema with the matching type,
// and every property of the schema is a field. (test/e2e's controller test also
// round-trips an object through an API server with the CRD installed.)
func TestCRDSchemaMatchesTypes(t *testing.T) {
	v := crdVersion(t, "../../deploy/controller/crd.yaml", "Namespaced", Kind, Resource, ListKind)
	if _, ok := v["subresources"].(map[string]any)["status"]; !ok {
		t.Fatal("the CRD has no status subresource")
	}
	props := v["schema"].(map[string]any)["openAPIV3Schema"].(map[string]any)["properties"].(map[string]any)
	check(t, "spec", reflect.TypeFor[ControlPlaneEncryptionSpec](), props["spec"].(map[string]any))
	check(t, "status", reflect.TypeFor[ControlPlaneEncryptionStatus](), props["status"].(map[string]any))
}

// crdVersion reads the CustomResourceDefinition at path, checks its group, scope and
// names against the Go constants and returns its one version.
func crdVersion(t *testing.T, path, scope, kind, plural, listKind string) map[string]any {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var crd map[string]any
	if err := yaml.Unmarshal(data, &crd); err != nil {
		t.Fatal(err)
	}
	spec := crd["spec"].(map[string]any)
	if spec["group"] != Group || spec["scope"] != scope {
		t.Fatalf("%s: group %v scope %v, want %s %s", path, spec["group"], spec["scope"], Group, scope)
	}
	names := spec["names"].(map[string]any)
	if names["kind"] != kind || names["plural"] != plural || names["listKind"] != listKind {
		t.Fatalf("%s: names %v do not match the Go constants", path, names)
	}
	v := spec["versions"].([]any)[0].(map[string]any)
	if v["name"] != Version {
		t.Fatalf("%s: version %v, want %s", path, v["name"], Version)
	}
	return v
}

var (
	durationType  = reflect.TypeFor[metav1.Duration]()
	timeType      = reflect.TypeFor[metav1.Time]()
	conditionType = reflect.TypeFor[metav1.Condition]()
)

func check(t *testing.T, path string, typ reflect.Type, s map[string]any) {
	t.Helper()
	for typ.Kind() == reflect.Pointer {
		typ = typ.Elem()
	}
	want := ""
	switch {
	case typ == durationType || typ.Kind() == reflect.String:
		want = "string"
	case typ == timeType:
		want = "string"
		if s["format"] != "date-time" {
			t.Errorf("%s: a time without format date-time", path)
		}
	case typ.Kind() == reflect.Int64:
		want = "integer"
	case typ.Kind() == reflect.Bool:
		want = "boolean"
	case typ.Kind() == reflect.Slice:
		want = "array"
	case typ.Kind() == reflect.Struct:
		want = "object"
	}
	if s["type"] != want {
		t.Errorf("%s: schema type %v, Go type %s wants %q", path, s["type"], typ, want)
		return
	}
	switch {
	case typ.Kind() == reflect.Slice:
		check(t, path+"[]", typ.Elem(), s["items"].(map[string]any))
	case typ.Kind() == reflect.Struct && typ != timeType && typ != durationType:
		props, _ := s["properties"].(map[string]any)
		var fields []string
		for i := range typ.NumField() {
			f := typ.Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
			if name == "" || name == "-" {
				t.Errorf("%s.%s has no JSON name", path, f.Name)
				continue
			}
			fields = append(fields, name)
			p, ok := props[name].(map[string]any)
			if !ok {
				t.Errorf("%s.%s: not in the CRD schema", path, name)
				continue
			}
			if typ == conditionType {
				continue
			}
			check(t, path+"."+name, f.Type, p)
			omit := strings.Contains(f.Tag.Get("json"), "omitempty")
			req, _ := s["required"].([]any)
			if !omit && f.Type.Kind() != reflect.Bool && !slices.Contains(req, any(name)) {
				t.Errorf("%s.%s is always serialized but not required in the schema", path, name)
			}
		}
		for p := range props {
			if !slices.Contains(fields, p) {
				t.Errorf("%s.%s: in the CRD schema, not in the Go type", path, p)
			}
		}
	}
}
