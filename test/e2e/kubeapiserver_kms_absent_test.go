package e2e

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/rekey-io/rekey/internal/testbed"
)

// TestKMSPluginAbsentKubeAPIServers measures TestKMSPluginAbsentAndGone's first half in
// kube-apiserver itself, rekey's (dist/kube-apiserver) and upstream's unmodified
// v1.37.2 side by side: Secrets under KMS v2 written with the plugin up, then each
// apiserver started with the plugin absent, then the plugin started. It logs one row
// per apiserver for BENCHMARKS.md; only rekey's row is held to the product's promises
// (ConfigMaps served, Secret reads answered fast with 503 naming the provider, the
// return to full service within the Status interval and slack). A measurement: E2E_LONG.
func TestKMSPluginAbsentKubeAPIServers(t *testing.T) {
	requireLong(t)
	kapi := kubeAPIServers(t)
	ctx := t.Context()
	for _, side := range []struct{ name, bin string }{{"rekey", kapi.Rekey}, {"upstream", kapi.Upstream}} {
		t.Run(side.name, func(t *testing.T) {
			row := measureKMSAbsentKubeAPIServer(ctx, t, side.name, side.bin)
			t.Logf("| %s | %s |", side.name, strings.Join(row, " | "))
		})
	}
}

// measureKMSAbsentKubeAPIServer runs the scenario against bin and returns the row's
// cells: ConfigMap served after start, Secret GET p50/p99 and answer, Secret LIST
// (limit 0 and 500) time and answer, Secret create answer, full service after the
// plugin started.
func measureKMSAbsentKubeAPIServer(ctx context.Context, t *testing.T, side, bin string) []string {
	dir := t.TempDir()
	const provider, ns, stored = "absent-kms", "absent", 5
	plugin := startPlugin(t, dir)
	sockDir := filepath.Dir(plugin.Socket)
	cfgPath := filepath.Join(dir, "encryption.yaml")
	writeConfig(t, cfgPath, "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n"+
		"- resources: [secrets]\n  providers:\n"+
		fmt.Sprintf("  - kms:\n      apiVersion: v2\n      name: %s\n      endpoint: %s\n      timeout: 3s\n", provider, plugin.Endpoint)+
		"- resources: [configmaps]\n  providers:\n"+identity)
	saKey := filepath.Join(dir, "sa.key")
	if err := testbed.WriteServiceAccountKey(saKey); err != nil {
		t.Fatal(err)
	}
	rekey := side == "rekey"
	// Its own etcd prefix, and a coordination prefix of its own (a repeated run must
	// not meet the cluster of the last one).
	prefix := uniquePrefix(t)
	cfg := testbed.KubeAPIServerConfig{Name: "kapi-absent-" + side, Dir: filepath.Join(dir, "kapi"), EtcdServers: []string{etcd.Endpoint},
		EtcdPrefix: prefix, ServiceAccountKey: saKey, EncryptionConfig: cfgPath}
	if rekey {
		cfg.Args = []string{"--kms-status-interval", absentStatusEvery.String(), "--coordination-prefix", coordinationPrefix(t) + prefix,
			"--encryption-state-id", strings.NewReplacer("/", "-").Replace(t.Name())}
	}

	// Data written with the plugin up, by an apiserver that then stops.
	{
		s, err := testbed.StartKubeAPIServer(ctx, bin, cfg)
		if err != nil {
			t.Fatal(err)
		}
		c := clientFor(t, s)
		if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		for i := range stored {
			if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("s-%d", i)},
				StringData: map[string]string{"v": "secret"}}, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := c.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "cm-0"}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		s.Stop(30 * time.Second)
		plugin.Stop(5 * time.Second)
	}

	// The plugin is absent at the start.
	launched := time.Now()
	s, err := testbed.LaunchKubeAPIServer(bin, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		s.Stop(30 * time.Second)
		if t.Failed() {
			t.Logf("%s log tail:\n%s", s.Name, s.Log(4000))
		}
	})
	c := clientFor(t, s)
	var row []string
	cmServed := time.Duration(-1)
	for time.Since(launched) < 90*time.Second {
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := c.CoreV1().ConfigMaps(ns).Get(rctx, "cm-0", metav1.GetOptions{})
		cancel()
		if err == nil {
			cmServed = time.Since(launched)
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if cmServed < 0 {
		t.Fatalf("%s: no ConfigMap served within 90 s of the start with the KMS plugin absent", side)
	}
	row = append(row, cmServed.Round(10*time.Millisecond).String())

	var reads latencies
	answer := ""
	for range 20 {
		start := time.Now()
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		_, err := c.CoreV1().Secrets(ns).Get(rctx, "s-0", metav1.GetOptions{})
		cancel()
		reads = append(reads, time.Since(start))
		answer = answerOf(err, provider)
		if rekey && (!apierrors.IsServiceUnavailable(err) || !strings.Contains(err.Error(), provider)) {
			t.Errorf("rekey: Secret GET with the plugin absent: %v, want a 503 naming %q", err, provider)
		}
	}
	if rekey && reads.p99() > absentReadP99Bound {
		t.Errorf("rekey: Secret GET with the plugin absent: %s, want p99 under %v", reads, absentReadP99Bound)
	}
	row = append(row, fmt.Sprintf("%v / %v, %s", reads.p50().Round(100*time.Microsecond), reads.p99().Round(100*time.Microsecond), answer))

	for _, limit := range []int64{0, 500} {
		start := time.Now()
		rctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		_, err := c.CoreV1().Secrets(ns).List(rctx, metav1.ListOptions{Limit: limit})
		cancel()
		took := time.Since(start)
		row = append(row, fmt.Sprintf("%v, %s", took.Round(time.Millisecond), answerOf(err, provider)))
		if rekey && (!apierrors.IsServiceUnavailable(err) || took > time.Second) {
			t.Errorf("rekey: Secret LIST (limit %d) with the plugin absent: %v after %v, want a 503 in under a second", limit, err, took)
		}
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	_, err = c.CoreV1().Secrets(ns).Create(rctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "refused"}}, metav1.CreateOptions{})
	cancel()
	row = append(row, answerOf(err, provider))

	// The plugin comes.
	plugin, err = testbed.StartPlugin(ctx, bins.Plugin, dir, sockDir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { plugin.Stop(5 * time.Second) })
	back := time.Now()
	full := time.Duration(-1)
	for time.Since(back) < 2*time.Minute {
		if fullService(ctx, c, ns) == nil {
			full = time.Since(back)
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	switch {
	case full < 0:
		row = append(row, "not within 2 min")
		if rekey {
			t.Errorf("rekey: no full service within 2 minutes of the plugin's start")
		}
	default:
		row = append(row, full.Round(10*time.Millisecond).String())
		if rekey && full > absentStatusEvery+absentRecoverySlack {
			t.Errorf("rekey: full service %v after the plugin started, want within %v", full, absentStatusEvery+absentRecoverySlack)
		}
	}
	return row
}

// fullService is nil once a GET and a LIST of Secrets and a Secret create succeed.
func fullService(ctx context.Context, c *kubernetes.Clientset, ns string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := c.CoreV1().Secrets(ns).Get(ctx, "s-0", metav1.GetOptions{}); err != nil {
		return err
	}
	if _, err := c.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{}); err != nil {
		return err
	}
	_, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{GenerateName: "after-"}}, metav1.CreateOptions{})
	return err
}

// answerOf is an answer's HTTP code and whether it names the provider, for the row.
func answerOf(err error, provider string) string {
	if err == nil {
		return "200"
	}
	var se apierrors.APIStatus
	if errors.As(err, &se) {
		st := se.Status()
		named := "does not name the provider"
		if strings.Contains(st.Message, provider) {
			named = "names the provider"
		}
		return fmt.Sprintf("%d %s (%s)", st.Code, st.Reason, named)
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return "no answer (client timeout)"
	}
	return "error: " + err.Error()
}

func (l latencies) p50() time.Duration {
	s := slices.Clone(l)
	slices.Sort(s)
	return s[len(s)/2]
}
