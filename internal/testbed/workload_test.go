package testbed

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// fakeEndpoint is an in-memory apiserver (client-go's fake clientset), a neighbour
// stand-in for the checks' own unit test.
type fakeEndpoint struct {
	name string
	c    *fake.Clientset
	out  atomic.Bool
}

func (f *fakeEndpoint) Name() string                          { return f.name }
func (f *fakeEndpoint) Client() (kubernetes.Interface, error) { return f.c, nil }
func (f *fakeEndpoint) InRotation() bool                      { return !f.out.Load() }

func setValue(t *testing.T, c kubernetes.Interface, name, v string) {
	t.Helper()
	s, err := c.CoreV1().Secrets("ns").Get(t.Context(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	s.Data[valueKey] = []byte(v)
	if _, err := c.CoreV1().Secrets("ns").Update(t.Context(), s, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// The end check and the sampler catch what they exist to catch: a value rolled back
// to before its last acknowledged write (lost), a value nobody wrote (overwritten),
// an acknowledged object gone (missing), and a server error (unreadable); failures on
// an endpoint out of rotation are excused.
func TestWorkloadChecksCatchLossAndErrors(t *testing.T) {
	ctx := t.Context()
	ep := &fakeEndpoint{name: "fake", c: fake.NewClientset()}
	w := NewWorkload("ns", []Endpoint{ep})
	if err := w.Seed(ctx, "s", 4, 2); err != nil {
		t.Fatal(err)
	}
	wr := &Writers{w: w, perEP: map[string]*WriteCounts{}}
	for _, name := range []string{"s-1", "s-2"} {
		if err := wr.update(ctx, ep.c, name, map[string]string{}); err != nil {
			t.Fatal(err)
		}
	}
	if rep, err := w.Verify(ctx, ep); err != nil || !rep.OK() || rep.Objects != 4 {
		t.Fatalf("untouched: %s (%v)", rep, err)
	}

	setValue(t, ep.c, "s-1", seqValue("s-1", 1)) // rolled back past its acknowledged #2
	setValue(t, ep.c, "s-2", "garbage")
	if err := ep.c.CoreV1().Secrets("ns").Delete(ctx, "s-3", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	rep, err := w.Verify(ctx, ep)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Lost) != 2 || !strings.HasPrefix(rep.Lost[0], "s-1=") || !strings.HasPrefix(rep.Lost[1], "s-3 (absent)") ||
		len(rep.Overwritten) != 1 || !strings.HasPrefix(rep.Overwritten[0], "s-2=") {
		t.Fatalf("verify: %s", rep)
	}

	// A write whose answer was lost may or may not be there: both are fine.
	w.maybe("s-0", 2)
	setValue(t, ep.c, "s-0", seqValue("s-0", 2))
	if rep, _ := w.Verify(ctx, ep); slices.ContainsFunc(append(rep.Lost, rep.Overwritten...), func(s string) bool { return strings.HasPrefix(s, "s-0") }) {
		t.Fatalf("a write with an unknown outcome counted as a loss: %s", rep)
	}

	// The sampler: s-1 (older) and s-2 (foreign value) stale, s-3 missing, a 500 on s-0.
	ep.c.PrependReactor("get", "secrets", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.(k8stesting.GetAction).GetName() == "s-0" {
			return true, nil, apierrors.NewInternalError(errTransform)
		}
		return false, nil, nil
	})
	s := &Sampler{w: w, perEP: map[string]*SampleCounts{"fake": {}}}
	for _, name := range []string{"s-0", "s-1", "s-2", "s-3"} {
		s.read(ctx, ep, name)
	}
	got := s.Report().Total()
	if got.Reads != 4 || got.Unreadable != 1 || got.Stale != 2 || got.Missing != 1 || got.Errors != 0 {
		t.Fatalf("sampler counts %+v; examples %v", got, s.Report().Examples)
	}
	ep.out.Store(true)
	s.read(ctx, ep, "s-0")
	if got := s.Report().Total(); got.Excused != 1 || got.Unreadable != 1 {
		t.Fatalf("a failure out of rotation: %+v", got)
	}
	// etcd's election error, as an apiserver answers it (a 500), is not an unreadable
	// object: it is counted apart, for a scenario to excuse once etcd's term proves an
	// election.
	ep.out.Store(false)
	ep.c.PrependReactor("get", "secrets", func(a k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewInternalError(errors.New("etcdserver: request timed out, possibly due to previous leader failure"))
	})
	s.read(ctx, ep, "s-0")
	if got := s.Report().Total(); got.LeaderLoss != 1 || got.Unreadable != 1 || got.Bad() != 5 {
		t.Fatalf("a read failed in a leader election: %+v", got)
	}
}

var errTransform = &transformError{}

type transformError struct{}

func (*transformError) Error() string { return "data from the storage is not transformable" }

// Writers count failures per endpoint and excuse those out of rotation; the record
// keeps the last acknowledged value of every object they touched.
func TestWritersCountAndRecord(t *testing.T) {
	ctx := t.Context()
	ep := &fakeEndpoint{name: "fake", c: fake.NewClientset()}
	w := NewWorkload("ns", []Endpoint{ep})
	if err := w.Seed(ctx, "s", 6, 2); err != nil {
		t.Fatal(err)
	}
	var failing atomic.Bool
	ep.c.PrependReactor("update", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		if failing.Load() {
			return true, nil, apierrors.NewServiceUnavailable("down")
		}
		return false, nil, nil
	})
	wr := w.StartWriters(ctx, WritersConfig{PerEndpoint: 2, Pause: time.Millisecond, CreateEvery: 5})
	waitFor := func(what string, f func(WriteReport) bool) {
		t.Helper()
		c, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		for !f(wr.Report()) {
			if c.Err() != nil {
				t.Fatalf("%s: %s", what, wr.Report())
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	waitFor("acknowledged writes", func(r WriteReport) bool { return r.Acked() > 20 })
	failing.Store(true)
	waitFor("failed writes", func(r WriteReport) bool { return r.Failed() > 3 })
	rep := wr.Stop()
	if rep.PerEndpoint["fake"].Excused != 0 || len(rep.Errors) == 0 || !strings.Contains(rep.Errors[0], "down") {
		t.Fatalf("report: %s, errors %v", rep, rep.Errors)
	}
	// A failure seen while the endpoint is out of rotation (killed) is excused.
	ep.out.Store(true)
	wr.count(ep, apierrors.NewServiceUnavailable("killed"))
	if r := wr.Report(); r.PerEndpoint["fake"].Excused != 1 || r.Failed() != rep.Failed() {
		t.Fatalf("after a failure out of rotation: %s", r)
	}
	// One in rotation with etcd's election error is failed, and counted as such.
	ep.out.Store(false)
	wr.count(ep, apierrors.NewInternalError(errors.New("etcdserver: leader changed")))
	if r := wr.Report(); r.Failed() != rep.Failed()+1 || r.LeaderLoss() != 1 {
		t.Fatalf("after a failure in a leader election: %s", r)
	}
	if w.Objects() <= 6 {
		t.Fatalf("no object created: %d", w.Objects())
	}
	failing.Store(false)
	ep.out.Store(false)
	v, err := w.Verify(ctx, ep)
	if err != nil || !v.OK() {
		t.Fatalf("verify after the writers: %s (%v)", v, err)
	}
}
