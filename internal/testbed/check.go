package testbed

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"google.golang.org/protobuf/proto"
	kmsv2api "k8s.io/apiserver/pkg/storage/value/encrypt/envelope/kmsv2/v2"

	"github.com/rekey-io/rekey/pkg/coordination"
)

// StoredPrefixes counts the values stored in etcd under keyPrefix by encryption
// prefix, up to the key name or KMS provider name ("k8s:enc:aesgcm:v1:key2:"), or
// "plaintext".
func StoredPrefixes(ctx context.Context, cli *clientv3.Client, keyPrefix string) (map[string]int, error) {
	resp, err := cli.Get(ctx, keyPrefix, clientv3.WithPrefix())
	if err != nil {
		return nil, err
	}
	out := map[string]int{}
	for _, kv := range resp.Kvs {
		out[EncryptionPrefix(kv.Value)]++
	}
	return out, nil
}

// EncryptionPrefix is a stored value's encryption prefix up to the key or KMS
// provider name, or "plaintext".
func EncryptionPrefix(v []byte) string {
	if !bytes.HasPrefix(v, []byte("k8s:enc:")) {
		return "plaintext"
	}
	parts := bytes.SplitN(v, []byte(":"), 6) // k8s enc <provider> <version> <key> rest
	if len(parts) < 6 {
		return "malformed"
	}
	return string(bytes.Join(parts[:5], []byte(":"))) + ":"
}

// AllStoredUnder checks that there is at least one value under keyPrefix and that
// every one carries encryption prefix want.
func AllStoredUnder(ctx context.Context, cli *clientv3.Client, keyPrefix, want string) error {
	got, err := StoredPrefixes(ctx, cli, keyPrefix)
	if err != nil {
		return err
	}
	if len(got) == 1 && got[want] > 0 {
		return nil
	}
	return fmt.Errorf("stored under %s: %v, want everything under %s", keyPrefix, got, want)
}

// KMSKeyID returns the KMS v2 key id a stored value was written under, decoded
// with kube-apiserver's own EncryptedObject type; "" for a value not written by KMS v2.
func KMSKeyID(stored []byte) (string, error) {
	p := EncryptionPrefix(stored)
	if !strings.HasPrefix(p, "k8s:enc:kms:v2:") {
		return "", nil
	}
	var o kmsv2api.EncryptedObject
	if err := proto.Unmarshal(stored[len(p):], &o); err != nil {
		return "", fmt.Errorf("decoding the KMS v2 EncryptedObject: %w", err)
	}
	return o.KeyID, nil
}

// StoredKMSKeyIDs counts the values under keyPrefix by "<encryption prefix><key id>"
// for KMS v2 values and by encryption prefix for the others.
func StoredKMSKeyIDs(ctx context.Context, cli *clientv3.Client, keyPrefix string) (map[string]int, error) {
	resp, err := cli.Get(ctx, keyPrefix, clientv3.WithPrefix())
	if err != nil {
		return nil, err
	}
	out := map[string]int{}
	for _, kv := range resp.Kvs {
		id, err := KMSKeyID(kv.Value)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", kv.Key, err)
		}
		out[EncryptionPrefix(kv.Value)+id]++
	}
	return out, nil
}

// StoredKeyIDProbe passes when every value under keyPrefix is a KMS v2 value of
// provider written under key id keyID.
func StoredKeyIDProbe(cli *clientv3.Client, keyPrefix, provider, keyID string) Probe {
	want := "k8s:enc:kms:v2:" + provider + ":" + keyID
	return Probe{Name: "stored " + want, Check: func(ctx context.Context) error {
		got, err := StoredKMSKeyIDs(ctx, cli, keyPrefix)
		if err != nil {
			return err
		}
		if len(got) == 1 && got[want] > 0 {
			return nil
		}
		return fmt.Errorf("stored under %s: %v, want everything under %s", keyPrefix, got, want)
	}}
}

// A Probe reports nil when the cluster shows what the test waits for, or what it
// shows instead.
type Probe struct {
	Name  string
	Check func(ctx context.Context) error
}

// WaitFor polls the probes every interval until all pass in the same round or ctx
// ends; the error names the probes still failing.
func WaitFor(ctx context.Context, interval time.Duration, probes ...Probe) error {
	for {
		var failing []string
		for _, p := range probes {
			cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			err := p.Check(cctx)
			cancel()
			if err != nil {
				failing = append(failing, p.Name+": "+err.Error())
			}
		}
		if len(failing) == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w; still: %s", ctx.Err(), strings.Join(failing, "; "))
		case <-time.After(interval):
		}
	}
}

// StoredUnderProbe passes when every value under keyPrefix carries encryption
// prefix want: convergence judged from etcd alone.
func StoredUnderProbe(cli *clientv3.Client, keyPrefix, want string) Probe {
	return Probe{Name: "stored " + want, Check: func(ctx context.Context) error {
		return AllStoredUnder(ctx, cli, keyPrefix, want)
	}}
}

// MembersKey is where a member publishes its state: <coordination prefix>/members/<id>
// (the members' directory for id ""). A prefix given with a trailing / names the same
// keys, as a flag value typed that way would mean.
func MembersKey(coordinationPrefix, id string) string {
	return coordination.Member(strings.TrimSuffix(coordinationPrefix, "/"), id)
}

// ReadMembers returns the member states published under the coordination prefix,
// by apiserver id, as raw JSON.
func ReadMembers(ctx context.Context, cli *clientv3.Client, coordinationPrefix string) (map[string]json.RawMessage, error) {
	dir := MembersKey(coordinationPrefix, "")
	resp, err := cli.Get(ctx, dir, clientv3.WithPrefix())
	if err != nil {
		return nil, err
	}
	out := map[string]json.RawMessage{}
	for _, kv := range resp.Kvs {
		out[strings.TrimPrefix(string(kv.Key), dir)] = json.RawMessage(kv.Value)
	}
	return out, nil
}

// MembersProbe passes when exactly the members ids are published and check passes
// for each one's state. The state's schema belongs to pkg/cluster; check decodes
// what it needs.
func MembersProbe(cli *clientv3.Client, coordinationPrefix string, ids []string, check func(id string, state json.RawMessage) error) Probe {
	return Probe{Name: "members", Check: func(ctx context.Context) error {
		members, err := ReadMembers(ctx, cli, coordinationPrefix)
		if err != nil {
			return err
		}
		if got := slices.Sorted(maps.Keys(members)); !slices.Equal(got, slices.Sorted(slices.Values(ids))) {
			return fmt.Errorf("members %v, want %v", got, ids)
		}
		var errs []error
		for _, id := range ids {
			if err := check(id, members[id]); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", id, err))
			}
		}
		return errors.Join(errs...)
	}}
}

// StatusProbe passes when check passes for the status document of every shim.
func StatusProbe(shims []*Shim, check func(s *Shim, doc StatusDoc) error) Probe {
	return Probe{Name: "status", Check: func(ctx context.Context) error {
		var errs []error
		for _, s := range shims {
			doc, err := s.Status(ctx)
			if err == nil {
				err = check(s, doc)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", s.Name, err))
			}
		}
		return errors.Join(errs...)
	}}
}

// StatusDoc is the part of the shim's /rekey/status the testbed reads; Raw is the
// whole document, for sections the testbed does not model (cluster, storage).
type StatusDoc struct {
	ActiveConfigHash string `json:"activeConfigHash"`
	ReloadsSucceeded int64  `json:"reloadsSucceeded"`
	ReloadsFailed    int64  `json:"reloadsFailed"`
	LastError        string `json:"lastError"`
	Raw              json.RawMessage
}

// Status fetches the shim's status document.
func (s *Shim) Status(ctx context.Context) (StatusDoc, error) {
	var doc StatusDoc
	hc, err := s.HTTPClient(true)
	if err != nil {
		return doc, err
	}
	defer hc.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL+"/rekey/status", nil)
	if err != nil {
		return doc, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return doc, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return doc, err
	}
	if resp.StatusCode != http.StatusOK {
		return doc, fmt.Errorf("/rekey/status: %s: %s", resp.Status, body)
	}
	if err := json.Unmarshal(body, &doc); err != nil {
		return doc, fmt.Errorf("/rekey/status: %w", err)
	}
	doc.Raw = body
	return doc, nil
}

// ConfigAppliedProbe passes when every shim serves with content (its
// activeConfigHash), and fails for good — WaitFor keeps polling, but the error says
// so — when a shim refused it (a failed reload after the baseline).
func ConfigAppliedProbe(shims []*Shim, content []byte, failedBefore map[string]int64) Probe {
	want := ConfigHash(content)
	return StatusProbe(shims, func(s *Shim, doc StatusDoc) error {
		if doc.ActiveConfigHash == want {
			return nil
		}
		if doc.ReloadsFailed > failedBefore[s.Name] {
			return fmt.Errorf("refused the config: %s", doc.LastError)
		}
		return fmt.Errorf("serving %s, not %s yet", doc.ActiveConfigHash, want)
	})
}

// FailedReloads returns each shim's reloadsFailed, the baseline for
// ConfigAppliedProbe.
func FailedReloads(ctx context.Context, shims []*Shim) (map[string]int64, error) {
	out := map[string]int64{}
	for _, s := range shims {
		doc, err := s.Status(ctx)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", s.Name, err)
		}
		out[s.Name] = doc.ReloadsFailed
	}
	return out, nil
}

// ApplyAndWaitAccepted writes content to every file through the syncer (with its
// delays) and waits until every shim serves with it: the check that dropping an old
// key is accepted once nothing needs it.
func ApplyAndWaitAccepted(ctx context.Context, syncer *FileSyncer, shims []*Shim, content []byte) error {
	before, err := FailedReloads(ctx, shims)
	if err != nil {
		return err
	}
	if _, err := syncer.Apply(ctx, content).Wait(ctx); err != nil {
		return err
	}
	return WaitFor(ctx, 200*time.Millisecond, ConfigAppliedProbe(shims, content, before))
}

// MigrationLeaderKey is the election prefix of the storage-migration leader (a trailing
// / of the prefix ignored, as in MembersKey).
func MigrationLeaderKey(coordinationPrefix string) string {
	return coordination.MigrationLeader(strings.TrimSuffix(coordinationPrefix, "/"))
}

// MigrationLeader returns the value the current migration leader campaigned with
// (its apiserver id), as etcd's election recipe defines the leader: the oldest key
// under the election prefix.
func MigrationLeader(ctx context.Context, cli *clientv3.Client, coordinationPrefix string) (string, error) {
	// A session is required to build an Election; Leader itself only reads.
	sess, err := concurrency.NewSession(cli, concurrency.WithTTL(5), concurrency.WithContext(ctx))
	if err != nil {
		return "", err
	}
	defer sess.Close()
	resp, err := concurrency.NewElection(sess, MigrationLeaderKey(coordinationPrefix)).Leader(ctx)
	if err != nil {
		return "", err // concurrency.ErrElectionNoLeader when nobody campaigns
	}
	return string(resp.Kvs[0].Value), nil
}
