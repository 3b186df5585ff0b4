// Package etcdunavailable tells an etcd request that failed because etcd could not
// answer it then (a member lost, a leader election, the attempt's own deadline) from
// one etcd refused or that was wrong: the first is worth another attempt once a new
// leader is elected, the second is not.
package etcdunavailable

import (
	"context"
	"errors"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// leaderErrors are etcd's answers while it has no leader or lost the one a proposal
// went to.
var leaderErrors = []error{rpctypes.ErrLeaderChanged, rpctypes.ErrNoLeader, rpctypes.ErrTimeout,
	rpctypes.ErrTimeoutDueToLeaderFail, rpctypes.ErrTimeoutDueToConnectionLost, rpctypes.ErrTimeoutWaitAppliedIndex}

// Is reports whether err says etcd could not answer the request then.
func Is(err error) bool {
	for _, e := range leaderErrors {
		if errors.Is(err, e) {
			return true
		}
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	if s, ok := status.FromError(err); ok {
		switch s.Code() {
		case codes.Unavailable, codes.DeadlineExceeded:
			return true
		}
	}
	return false
}
