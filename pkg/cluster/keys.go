package cluster

import "github.com/rekey-io/rekey/pkg/coordination"

// The keys of this package live in pkg/coordination's table with every other key under
// the coordination prefix; the names below stay because other packages and the tests of
// many use them.

// DefaultPrefix is the default coordination prefix (--coordination-prefix).
const DefaultPrefix = coordination.DefaultPrefix

// MembersPrefix is the directory of member keys: <prefix>/members/.
func MembersPrefix(prefix string) string { return coordination.MembersPrefix(prefix) }

// MemberKey is where apiserver id publishes its MemberState.
func MemberKey(prefix, id string) string { return coordination.Member(prefix, id) }

// MigrationStateKey holds the leader's MigrationState: records and progress.
func MigrationStateKey(prefix string) string { return coordination.MigrationState(prefix) }
