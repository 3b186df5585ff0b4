package migrate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/pkg/coordination"
)

// acknowledgementKey is where the acknowledgement of the object at etcd key key of res
// lives: <coordination-prefix>/acknowledged/<resource>/<ns>/<name>, or
// .../<resource>/<name> for a cluster-scoped resource.
func acknowledgementKey(coordinationPrefix string, res Resource, key string) string {
	ns, name := objectName(res, key)
	return coordination.Acknowledgement(coordinationPrefix, res.String(), ns, name)
}

// Acknowledgement records that an operator knows one stored object is unreadable and
// accepts that it stays so: a migration verifies except it, and the guard lets its key
// go. It holds for the value at ModRevision only: a rewrite of the object voids it.
type Acknowledgement struct {
	Resource string `json:"resource"`
	UnreadableObject
	At     time.Time `json:"at"`
	Reason string    `json:"reason"`
	// By is the --apiserver-id of whoever recorded it, or DefaultAcknowledgedBy.
	By string `json:"by"`
}

// Acknowledgements are the recorded acknowledgements by etcd key of the object.
type Acknowledgements map[string]Acknowledgement

// Covers reports whether the value at key with modRevision is acknowledged.
func (a Acknowledgements) Covers(key string, modRevision int64) bool {
	ack, ok := a[key]
	return ok && ack.ModRevision == modRevision
}

// Sorted returns the acknowledgements by resource and etcd key.
func (a Acknowledgements) Sorted() []Acknowledgement {
	out := make([]Acknowledgement, 0, len(a))
	for _, ack := range a {
		out = append(out, ack)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Resource != out[j].Resource {
			return out[i].Resource < out[j].Resource
		}
		return out[i].Key < out[j].Key
	})
	return out
}

// acknowledgementPage bounds one read of acknowledgements: a page, then one transaction
// reading the mod revisions of its objects (as many reads as the page holds, under
// etcd's default --max-txn-ops of 128).
const acknowledgementPage = 100

// loadAcknowledgements reads the acknowledgements under coordinationPrefix that are in
// force: the value acknowledged is still its object's. It reads them page by page, and
// deletes the void ones on the way (Acknowledger.Collect); a void one it cannot delete
// now is left for the next load: it covers nothing either way. Without a coordination
// prefix there are none.
func loadAcknowledgements(ctx context.Context, cli *clientv3.Client, coordinationPrefix string) (Acknowledgements, error) {
	if coordinationPrefix == "" {
		return nil, nil
	}
	c, err := collectAcknowledgements(ctx, cli, coordinationPrefix, acknowledgementPage)
	return c.InForce, err
}

// CollectedAcknowledgements is what Acknowledger.Collect found.
type CollectedAcknowledgements struct {
	// InForce are the acknowledgements whose object still holds the value acknowledged.
	InForce Acknowledgements
	// Deleted are the void ones it deleted: their object was rewritten or deleted.
	Deleted []Acknowledgement
	// DeleteErr is why some void ones could not be deleted (they are left for the next
	// collection; nil when every one was).
	DeleteErr error
}

// Collect reads the acknowledgements under the coordination prefix in pages of
// acknowledgementPage, compares each with the mod revision its object has now, and
// deletes the void ones: an object rewritten (a new mod revision) or deleted since was
// acknowledged for a value that is gone, and nothing else ever removes its record. A
// deletion is a transaction that succeeds only while the object's mod revision still
// differs from the acknowledged one and the acknowledgement is still the one read, so it
// never removes an acknowledgement recorded again meanwhile. A record that does not
// decode is left alone (ignoring it makes its object block, the safe side).
func (a Acknowledger) Collect(ctx context.Context) (CollectedAcknowledgements, error) {
	return collectAcknowledgements(ctx, a.Client, a.CoordinationPrefix, acknowledgementPage)
}

func collectAcknowledgements(ctx context.Context, cli clientv3.KV, coordinationPrefix string, pageSize int64) (CollectedAcknowledgements, error) {
	dir := coordination.AcknowledgedPrefix(coordinationPrefix)
	out := CollectedAcknowledgements{InForce: Acknowledgements{}}
	// The scans' pager: pages bounded in keys and bytes.
	p := newPager(cli, Resource{KeyPrefix: dir}, "", pageSize, false)
	for {
		kvs, err := p.page(ctx)
		if err != nil {
			return out, fmt.Errorf("reading the acknowledged unreadable objects under %s: %w", dir, err)
		}
		if len(kvs) == 0 {
			return out, nil
		}
		var page []ackRecord
		for _, kv := range kvs {
			var ack Acknowledgement
			if err := json.Unmarshal(kv.Value, &ack); err != nil || ack.Key == "" {
				continue
			}
			page = append(page, ackRecord{ack: ack, key: string(kv.Key), rev: kv.ModRevision})
		}
		if err := out.sortPage(ctx, cli, page); err != nil {
			return out, err
		}
	}
}

// ackRecord is an acknowledgement as read: its etcd key and mod revision.
type ackRecord struct {
	ack Acknowledgement
	key string
	rev int64
}

// sortPage reads the mod revisions of page's objects in one transaction and files each
// acknowledgement as in force or void; the void ones are deleted.
func (c *CollectedAcknowledgements) sortPage(ctx context.Context, cli clientv3.KV, page []ackRecord) error {
	if len(page) == 0 {
		return nil
	}
	gets := make([]clientv3.Op, len(page))
	for i, r := range page {
		gets[i] = clientv3.OpGet(r.ack.Key, clientv3.WithKeysOnly())
	}
	resp, err := cli.Txn(ctx).Then(gets...).Commit()
	if err != nil {
		return fmt.Errorf("reading the objects of %d acknowledgements: %w", len(page), err)
	}
	for i, r := range page {
		var now int64 // 0: the object is gone
		if kvs := resp.Responses[i].GetResponseRange().GetKvs(); len(kvs) > 0 {
			now = kvs[0].ModRevision
		}
		if now == r.ack.ModRevision {
			c.InForce[r.ack.Key] = r.ack
			continue
		}
		del, err := cli.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(r.ack.Key), "!=", r.ack.ModRevision),
				clientv3.Compare(clientv3.ModRevision(r.key), "=", r.rev)).
			Then(clientv3.OpDelete(r.key)).
			Commit()
		switch {
		case err != nil:
			c.DeleteErr = errors.Join(c.DeleteErr, fmt.Errorf("deleting the void acknowledgement %s: %w", r.key, err))
		case del.Succeeded:
			c.Deleted = append(c.Deleted, r.ack)
		}
		// Not succeeded: the acknowledgement was recorded again since it was read (for
		// the object's new value); the next collection looks at it again.
	}
	return nil
}

// Acknowledger records, lists and removes the acknowledgements of unreadable objects
// under one coordination prefix (rekey migrate --acknowledge-unreadable and its
// siblings); the inventories read them themselves.
type Acknowledger struct {
	Client             *clientv3.Client
	CoordinationPrefix string
	// Source is the configuration in use: only an object it cannot read is acknowledged
	// (Acknowledge needs it; Collect and Remove do not).
	Source Source
	// By is who acknowledges (default DefaultAcknowledgedBy); Clock dates it.
	By    string
	Clock clock.PassiveClock
}

// ErrReadable refuses to acknowledge an object the configuration can read.
var ErrReadable = errors.New("the object is readable with the current configuration")

// Acknowledge checks that the object namespace/name of res (namespace "" for a
// cluster-scoped resource) is unreadable now and records an acknowledgement of its
// current value, for reason. The record is written only while the value is still the
// one checked (a compare on its mod revision).
func (o Acknowledger) Acknowledge(ctx context.Context, res Resource, namespace, name, reason string) (Acknowledgement, error) {
	if o.Client == nil || o.Source == nil {
		return Acknowledgement{}, errors.New("migrate: acknowledging needs an etcd client and the transformers' source")
	}
	if reason == "" {
		return Acknowledgement{}, errors.New("an acknowledgement needs a reason (--reason): say why the object may stay unreadable")
	}
	if o.Clock == nil {
		o.Clock = clock.RealClock{}
	}
	if o.By == "" {
		o.By = DefaultAcknowledgedBy
	}
	key := objectKey(res, namespace, name)
	what := fmt.Sprintf("%s %s", res, key)
	resp, err := o.Client.Get(ctx, key)
	if err != nil {
		return Acknowledgement{}, fmt.Errorf("reading %s: %w", what, err)
	}
	if len(resp.Kvs) == 0 {
		return Acknowledgement{}, fmt.Errorf("%s: no object is stored there; check the namespace and name (rekey inventory lists the unreadable ones)", what)
	}
	kv := resp.Kvs[0]
	rule := o.Source.Rule(res.GroupResource)
	cl := newClassifier(rule, o.Source.KnownPrefixes())
	b := cl.classify(kv.Value)
	r := checkOne(ctx, o.Source.TransformerFor(res.GroupResource), kv.Key, kv.Value)
	if isTransient(r.err) {
		return Acknowledgement{}, fmt.Errorf("%s: cannot tell whether it is readable: %w; retry when the KMS plugin answers", what, r.err)
	}
	if r.err == nil {
		return Acknowledgement{}, fmt.Errorf("%s: %w, so there is nothing to acknowledge; a migration rewrites it", what, ErrReadable)
	}
	ns, n := objectName(res, key)
	ack := Acknowledgement{
		Resource: res.String(),
		UnreadableObject: UnreadableObject{Key: key, Namespace: ns, Name: n, Prefix: storedPrefixName(b),
			Class: unreadableClass(b, cl.readable[b.Prefix], r.err), ModRevision: kv.ModRevision, Acknowledged: true},
		At: o.Clock.Now().UTC(), Reason: reason, By: o.By,
	}
	data, err := json.Marshal(ack)
	if err != nil {
		return Acknowledgement{}, err
	}
	txn, err := o.Client.Txn(ctx).
		If(clientv3.Compare(clientv3.ModRevision(key), "=", kv.ModRevision)).
		Then(clientv3.OpPut(acknowledgementKey(o.CoordinationPrefix, res, key), string(data))).
		Commit()
	if err != nil {
		return Acknowledgement{}, fmt.Errorf("recording the acknowledgement of %s: %w", what, err)
	}
	if !txn.Succeeded {
		return Acknowledgement{}, fmt.Errorf("%s changed while it was checked; run the command again", what)
	}
	return ack, nil
}

// Remove deletes the acknowledgement of the object at namespace/name of res; it reports
// whether there was one.
func (o Acknowledger) Remove(ctx context.Context, res Resource, namespace, name string) (bool, error) {
	key := objectKey(res, namespace, name)
	resp, err := o.Client.Delete(ctx, acknowledgementKey(o.CoordinationPrefix, res, key))
	if err != nil {
		return false, fmt.Errorf("removing the acknowledgement of %s %s: %w", res, key, err)
	}
	return resp.Deleted > 0, nil
}
