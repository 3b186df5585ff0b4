package testbed

import (
	"bytes"
	"context"
	"os"
	"slices"
	"sync"
	"time"
)

// SourceFollower is the operator's single copy of an encryption config (a Secret, a
// file in Git) and the kubelets that copy it to every apiserver's node: it polls the
// source file and applies each new content through a FileSyncer, one round after the
// other.
type SourceFollower struct {
	cancel context.CancelFunc
	done   chan struct{}
	mu     sync.Mutex
	list   []SourceRound
}

// SourceRound is one content of the source file on its way to every node.
type SourceRound struct {
	// Detected is when the source file was seen changed (within 20 ms).
	Detected time.Time
	Round    *SyncRound
}

// FollowSource starts following path, whose content is initial now, until ctx ends or
// Stop.
func FollowSource(ctx context.Context, path string, initial []byte, syncer *FileSyncer) *SourceFollower {
	ctx, cancel := context.WithCancel(ctx)
	s := &SourceFollower{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		last := initial
		var prev *SyncRound
		for {
			select {
			case <-ctx.Done():
				return
			case <-time.After(20 * time.Millisecond):
			}
			data, err := os.ReadFile(path)
			if err != nil || len(data) == 0 || bytes.Equal(data, last) {
				continue // a missing or empty file is a write in progress
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
			last = data
			prev = syncer.Apply(ctx, data)
			s.mu.Lock()
			s.list = append(s.list, SourceRound{Detected: detected, Round: prev})
			s.mu.Unlock()
		}
	}()
	return s
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
