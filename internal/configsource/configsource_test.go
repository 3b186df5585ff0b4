package configsource_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rekey-io/rekey/internal/configsource"
	"github.com/rekey-io/rekey/internal/shimtest"
)

func TestParseSecretRef(t *testing.T) {
	for in, want := range map[string]string{
		"kube-system/encryption":             "secret kube-system/encryption",
		"hcp-a/kas-secret-encryption:config": "secret hcp-a/kas-secret-encryption key config",
		"ns/name:encryption-config.yaml":     "secret ns/name key encryption-config.yaml",
	} {
		ref, err := configsource.ParseSecretRef(in)
		if err != nil || ref.String() != want {
			t.Errorf("ParseSecretRef(%q) = %v, %v; want %s", in, ref, err, want)
		}
	}
	for _, in := range []string{"", "name", "/name", "ns/", "ns/a/b", "NS/name", "ns/name:bad key", "ns/na_me"} {
		if _, err := configsource.ParseSecretRef(in); err == nil || !strings.Contains(err.Error(), "--secret") {
			t.Errorf("ParseSecretRef(%q) = %v, want an error naming --secret", in, err)
		}
	}
}

// A Secret source through a real API: reads give the key's bytes at the Secret's
// resourceVersion; a replacement at that version keeps the Secret's other keys, labels
// and annotations; one at an older version, or two racing from one read, store exactly
// one edit and refuse the other with ErrChanged.
func TestSecretSource(t *testing.T) {
	api := shimtest.Start(t)
	ctx := context.Background()
	secrets := api.Client.CoreV1().Secrets("default")
	_, err := secrets.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "kas-encryption", Labels: map[string]string{"app": "kas"}, Annotations: map[string]string{"hash": "x"}},
		Data:       map[string][]byte{"config.yaml": []byte("v1"), "other": []byte("kept")},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	src := configsource.Secret{Client: api.Client.CoreV1(), Ref: configsource.SecretRef{Namespace: "default", Name: "kas-encryption", Key: "config.yaml"}}
	data, v1, err := src.Read(ctx)
	if err != nil || string(data) != "v1" || v1 == "" {
		t.Fatalf("Read = %q at %q, %v; want v1 at a resourceVersion", data, v1, err)
	}
	if err := src.Replace(ctx, v1, []byte("v2")); err != nil {
		t.Fatalf("Replace at the version read: %v", err)
	}
	sec, err := secrets.Get(ctx, "kas-encryption", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if string(sec.Data["config.yaml"]) != "v2" || string(sec.Data["other"]) != "kept" || sec.Labels["app"] != "kas" || sec.Annotations["hash"] != "x" {
		t.Fatalf("after Replace: data %q, labels %v, annotations %v", sec.Data, sec.Labels, sec.Annotations)
	}
	if err := src.Replace(ctx, v1, []byte("stale")); !errors.Is(err, configsource.ErrChanged) {
		t.Fatalf("Replace at an older version: %v, want ErrChanged", err)
	}

	// Two editors decided on the same version: one edit is stored, the other refused.
	_, v2, err := src.Read(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, content := range []string{"edit-a", "edit-b"} {
		wg.Go(func() { errs[i] = src.Replace(ctx, v2, []byte(content)) })
	}
	wg.Wait()
	ok, changed := 0, 0
	for _, err := range errs {
		switch {
		case err == nil:
			ok++
		case errors.Is(err, configsource.ErrChanged):
			changed++
		default:
			t.Fatalf("racing Replace: %v", err)
		}
	}
	data, _, err = src.Read(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if ok != 1 || changed != 1 || (string(data) != "edit-a" && string(data) != "edit-b") {
		t.Fatalf("two Replaces from one read: %d stored, %d refused, content %q; want exactly one stored", ok, changed, data)
	}

	// Without a key, the Secret's only key; with several, the error lists them.
	if _, _, err := (configsource.Secret{Client: api.Client.CoreV1(), Ref: configsource.SecretRef{Namespace: "default", Name: "kas-encryption"}}).Read(ctx); err == nil ||
		!strings.Contains(err.Error(), "has 2 data keys (config.yaml, other): name the one with the configuration, --secret default/kas-encryption:KEY") {
		t.Fatalf("a Secret of two keys read without a key: %v", err)
	}
	if _, err := secrets.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "one-key"}, Data: map[string][]byte{"enc": []byte("only")}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if data, _, err := (configsource.Secret{Client: api.Client.CoreV1(), Ref: configsource.SecretRef{Namespace: "default", Name: "one-key"}}).Read(ctx); err != nil || string(data) != "only" {
		t.Fatalf("a Secret of one key read without a key: %q, %v", data, err)
	}
	if _, _, err := (configsource.Secret{Client: api.Client.CoreV1(), Ref: configsource.SecretRef{Namespace: "default", Name: "one-key", Key: "nope"}}).Read(ctx); err == nil ||
		!strings.Contains(err.Error(), `has no data key "nope" (its keys: enc)`) {
		t.Fatalf("a missing key: %v", err)
	}
	if _, _, err := (configsource.Secret{Client: api.Client.CoreV1(), Ref: configsource.SecretRef{Namespace: "default", Name: "absent"}}).Read(ctx); err == nil ||
		!strings.Contains(err.Error(), "secret default/absent: not found") {
		t.Fatalf("a missing Secret: %v", err)
	}
}
