package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/rekey-io/rekey/internal/testbed"
)

// What the rotation and scale scenarios share to tell when apiservers serve a config:
// the hash each one exposes on /metrics.

const (
	// lastConfigInfo is the metric both layers expose with the hash of the config they
	// serve: "sha256:" and the hex SHA-256 of the file's bytes (k8s.io/apiserver's
	// encryptionconfig computeEncryptionConfigHash, and pkg/config.Hash). Its name is
	// BuildFQName("apiserver", "encryption_config_controller", "last_config_info") in
	// k8s.io/apiserver's encryptionconfig/metrics: there is no "automatic_reload" in it.
	lastConfigInfo = "apiserver_encryption_config_controller_last_config_info"
)

// waitConfigHash polls every shim's /metrics until its last_config_info metric shows
// the hash of content, and returns when the last one did.
func waitConfigHash(ctx context.Context, fleet *testbed.Fleet, content []byte, timeout time.Duration) (time.Time, error) {
	want := testbed.ConfigHash(content)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	shims := fleet.Running()
	clients := make([]*http.Client, len(shims))
	for i, s := range shims {
		c, err := s.HTTPClient(true)
		if err != nil {
			return time.Time{}, err
		}
		defer c.CloseIdleConnections()
		clients[i] = c
	}
	pending := map[int]string{}
	for i := range shims {
		pending[i] = "not asked yet"
	}
	for {
		for i := range pending {
			got, err := configHashes(ctx, clients[i], shims[i].URL)
			switch {
			case err != nil:
				pending[i] = err.Error()
			case len(got) > 0 && !slices.ContainsFunc(got, func(h string) bool { return h != want }):
				delete(pending, i)
			default:
				pending[i] = fmt.Sprintf("reports %v", got)
			}
		}
		if len(pending) == 0 {
			return time.Now(), nil
		}
		select {
		case <-ctx.Done():
			var why []string
			for i, p := range pending {
				why = append(why, shims[i].Name+": "+p)
			}
			slices.Sort(why)
			return time.Time{}, fmt.Errorf("waiting for every apiserver's %s to show %s: %w (%s)", lastConfigInfo, want, ctx.Err(), strings.Join(why, "; "))
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// configHashes returns the hash labels of the last_config_info samples of one
// apiserver's /metrics.
func configHashes(ctx context.Context, c *http.Client, url string) ([]string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("/metrics: %s", resp.Status)
	}
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	return parseConfigHashes(body), nil
}

// parseConfigHashes picks the hash label out of every last_config_info sample of a
// Prometheus text exposition.
func parseConfigHashes(body []byte) []string {
	var out []string
	for _, line := range bytes.Split(body, []byte("\n")) {
		rest, ok := bytes.CutPrefix(line, []byte(lastConfigInfo+"{"))
		if !ok {
			continue
		}
		_, after, ok := bytes.Cut(rest, []byte(`hash="`))
		// apiserver_id_hash="..." also ends in hash=": only a label that starts the
		// label set or follows a comma is the config hash.
		for ok {
			start := len(rest) - len(after) - len(`hash="`)
			if start == 0 || rest[start-1] == ',' {
				break
			}
			_, after, ok = bytes.Cut(after, []byte(`hash="`))
		}
		if !ok {
			continue
		}
		if v, _, ok := bytes.Cut(after, []byte(`"`)); ok {
			out = append(out, string(v))
		}
	}
	return out
}
