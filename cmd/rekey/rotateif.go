package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/rekey-io/rekey/internal/rotation"
	"github.com/rekey-io/rekey/pkg/cluster"
)

// rotateCondition is --if-writes-over and --if-older-than: rotate only when the write
// key has sealed more values than its budget, or is older than its limit (either, when
// both are given), as the cluster's totals in etcd say (cluster.KeyTotal).
type rotateCondition struct {
	writesOver uint64
	olderThan  days
}

func (rc *rotateCondition) addFlags(fs *pflag.FlagSet) {
	fs.Uint64Var(&rc.writesOver, "if-writes-over", 0, "Rotate only if a write key sealed more values than this in the cluster's lifetime (aesgcm: 200000, upstream's guidance for random 96-bit nonces). Needs --etcd-servers.")
	fs.Var(&rc.olderThan, "if-older-than", "Rotate only if a write key was first configured longer ago than this (30d, 12h; d is 24h). With --if-writes-over: either suffices. Needs --etcd-servers.")
}

func (rc rotateCondition) active() bool { return rc.condition().Active() }

// condition is the flags' pure decision (internal/rotation).
func (rc rotateCondition) condition() rotation.Condition {
	return rotation.Condition{WritesOver: rc.writesOver, OlderThan: time.Duration(rc.olderThan)}
}

// days is a duration flag that also reads whole days ("30d").
type days time.Duration

func (d *days) String() string {
	if *d == 0 {
		return ""
	}
	return rotation.FormatAge(time.Duration(*d))
}

func (d *days) Set(s string) error {
	if n, ok := strings.CutSuffix(s, "d"); ok {
		v, err := strconv.ParseUint(n, 10, 32)
		if err != nil || v == 0 {
			return fmt.Errorf("%q: want a whole number of days (30d) or a Go duration (12h)", s)
		}
		*d = days(time.Duration(v) * 24 * time.Hour)
		return nil
	}
	v, err := time.ParseDuration(s)
	if err != nil || v <= 0 {
		return fmt.Errorf("%q: want a whole number of days (30d) or a positive Go duration (12h)", s)
	}
	*d = days(v)
	return nil
}

func (d *days) Type() string { return "duration" }

// rotationDue reads the cluster's totals and the members' records, and has
// internal/rotation decide rc for the write keys of the rules rotate would change
// (--resources picks rules).
func (c *common) rotationDue(ctx context.Context, f *rotation.File, rc rotateCondition, prefix string) (bool, string, error) {
	if len(c.etcd.Servers) == 0 {
		return false, "", errors.New("--if-writes-over and --if-older-than need --etcd-servers: the write counts and key ages are the cluster's, in etcd")
	}
	s, err := c.open(ctx, preamble{})
	if err != nil {
		return false, "", err
	}
	defer s.Close()
	prefix = c.coordinationPrefix(prefix)
	totals, err := cluster.ReadKeyTotals(ctx, s.etcd, prefix)
	if err != nil {
		return false, "", err
	}
	snap, err := cluster.ReadSnapshot(ctx, s.etcd, prefix)
	if err != nil {
		return false, "", err
	}
	rotate, why := rc.condition().Due(rotation.WriteKeys(f, c.resources, totals, snap.Members), time.Now())
	return rotate, why, nil
}
