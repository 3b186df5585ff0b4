package testbed

import (
	"bytes"
	"context"
	"os"
	"slices"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
)

// SourceFollower is the operator's single copy of an encryption config (a Secret, a
// file in Git) and the kubelets that copy it to every apiserver's node: it polls the
// source and applies each new content through a FileSyncer, one round after the
// other. A node can be stuck (Stick): its copy never updates, as with a subPath mount,
// until Unstick brings it the latest content.
type SourceFollower struct {
	cancel context.CancelFunc
	done   chan struct{}
	syncer *FileSyncer
	ctx    context.Context

	mu     sync.Mutex
	list   []SourceRound
	latest []byte
	stuck  map[int]bool
}

// SourceRound is one content of the source on its way to every node.
type SourceRound struct {
	// Detected is when the source was seen changed (within one poll).
	Detected time.Time
	Round    *SyncRound
}

// FollowSource starts following the file path, whose content is initial now, until
// ctx ends or Stop.
func FollowSource(ctx context.Context, path string, initial []byte, syncer *FileSyncer) *SourceFollower {
	return follow(ctx, 20*time.Millisecond, func(context.Context) ([]byte, error) { return os.ReadFile(path) }, initial, syncer)
}

// FollowSecret starts following the data key of a Secret, whose value is initial now,
// until ctx ends or Stop: a projector, as the kubelet projects a Secret into a pod
// (polled every 100 ms; the syncer adds each node's delay).
func FollowSecret(ctx context.Context, secrets corev1client.SecretsGetter, namespace, name, key string, initial []byte, syncer *FileSyncer) *SourceFollower {
	return follow(ctx, 100*time.Millisecond, func(ctx context.Context) ([]byte, error) {
		sec, err := secrets.Secrets(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return nil, err
		}
		return sec.Data[key], nil
	}, initial, syncer)
}

func follow(ctx context.Context, every time.Duration, read func(context.Context) ([]byte, error), initial []byte, syncer *FileSyncer) *SourceFollower {
	ctx, cancel := context.WithCancel(ctx)
	s := &SourceFollower{cancel: cancel, done: make(chan struct{}), syncer: syncer, ctx: ctx, latest: initial, stuck: map[int]bool{}}
	go func() {
		defer close(s.done)
		var prev *SyncRound
		for {
			select {
			case <-ctx.Done():
				return
			case <-time.After(every):
			}
			data, err := read(ctx)
			s.mu.Lock()
			last := s.latest
			s.mu.Unlock()
			if err != nil || len(data) == 0 || bytes.Equal(data, last) {
				continue // a missing or empty source is a write in progress
			}
			detected := time.Now()
			if prev != nil {
				// A kubelet applies the latest content; the rounds stay one after the
				// other so "last file update" is well defined.
				select {
				case <-ctx.Done():
					return
				case <-prev.Done():
				}
			}
			s.mu.Lock()
			s.latest = data
			prev = syncer.ApplyEach(ctx, func(int) []byte { return data }, s.unstuckLocked())
			s.list = append(s.list, SourceRound{Detected: detected, Round: prev})
			s.mu.Unlock()
		}
	}()
	return s
}

// unstuckLocked lists the nodes whose copy updates (never nil: an empty list is none).
func (s *SourceFollower) unstuckLocked() []int {
	out := []int{}
	for i := range s.syncer.Files() {
		if !s.stuck[i] {
			out = append(out, i)
		}
	}
	return out
}

// Stick makes node i's copy stop updating (a subPath mount, a broken projection).
func (s *SourceFollower) Stick(i int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stuck[i] = true
}

// Unstick makes node i's copy update again, starting with the latest content (after
// its delay); the round is returned and listed.
func (s *SourceFollower) Unstick(i int) *SyncRound {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.stuck, i)
	latest := s.latest
	r := s.syncer.ApplyEach(s.ctx, func(int) []byte { return latest }, []int{i})
	s.list = append(s.list, SourceRound{Detected: time.Now(), Round: r})
	return r
}

// Stop stops following; rounds already started go on.
func (s *SourceFollower) Stop() {
	s.cancel()
	<-s.done
}

// Rounds returns the rounds started so far, oldest first.
func (s *SourceFollower) Rounds() []SourceRound {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.list)
}
