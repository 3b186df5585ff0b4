package testbed

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"
)

// A rendered config is one kube-apiserver's own loader accepts, with the providers
// in order; WithoutKey drops exactly the named key.
func TestEncryptionConfigRenderAndDrop(t *testing.T) {
	k1, k2 := NamedKey{"key1", RandomKey()}, NamedKey{"key2", RandomKey()}
	cfg := EncryptionConfig{
		{Resources: []string{"secrets"}, Providers: []Provider{AESGCM(k2, k1), Identity()}},
		{Resources: []string{"configmaps"}, Providers: []Provider{AESGCM(k1)}},
	}
	dir := t.TempDir()
	load := func(c EncryptionConfig) value.ResourceTransformers {
		t.Helper()
		path := filepath.Join(dir, "enc.yaml")
		if err := os.WriteFile(path, c.Render(), 0o600); err != nil {
			t.Fatal(err)
		}
		tr, err := Upstream(t.Context(), path)
		if err != nil {
			t.Fatalf("upstream rejects the rendered config: %v\n%s", err, c.Render())
		}
		return tr
	}
	secrets := schema.GroupResource{Resource: "secrets"}
	sealed, err := load(cfg).TransformerForResource(secrets).TransformToStorage(t.Context(), []byte("x"), value.DefaultContext("k"))
	if err != nil {
		t.Fatal(err)
	}
	if got := EncryptionPrefix(sealed); got != "k8s:enc:aesgcm:v1:key2:" {
		t.Fatalf("written under %q, want key2 (the first key)", got)
	}

	dropped := cfg.WithoutKey("key1")
	out := string(dropped.Render())
	if strings.Contains(out, "key1") || !strings.Contains(out, "key2") || !strings.Contains(out, "identity") {
		t.Fatalf("without key1:\n%s", out)
	}
	if len(dropped[1].Providers) != 0 {
		t.Fatalf("configmaps kept %v", dropped[1].Providers)
	}
	if strings.Contains(string(cfg.Render()), "key1") == false {
		t.Fatal("WithoutKey changed its receiver")
	}
	if ConfigHash([]byte("a")) == ConfigHash([]byte("b")) || !strings.HasPrefix(ConfigHash(nil), "sha256:") {
		t.Fatal("ConfigHash")
	}
	if EncryptionPrefix([]byte("k8s\x00plain")) != "plaintext" || EncryptionPrefix([]byte("k8s:enc:kms:v2:p:x")) != "k8s:enc:kms:v2:p:" {
		t.Fatal("EncryptionPrefix")
	}
}

func TestAESGCMKeyNames(t *testing.T) {
	k1 := NamedKey{Name: "key1", Secret: RandomKey()}
	k2 := NamedKey{Name: "key2", Secret: RandomKey()}
	got, err := AESGCMKeyNames(SecretsConfig(AESGCM(k2, k1), Identity()).Render())
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"key2", "key1"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("AESGCMKeyNames = %v, want %v", got, want)
	}
	if _, err := AESGCMKeyNames([]byte("resources: [")); err == nil {
		t.Fatal("AESGCMKeyNames accepted broken YAML")
	}
}
