package cluster

import "github.com/rekey-io/rekey/pkg/coordination"

// The keys of this package live in pkg/coordination's table with every other key under
// the coordination prefix; other packages use that table. These short names serve this
// package and its tests.

// defaultPrefix is the default coordination prefix (--coordination-prefix).
const defaultPrefix = coordination.DefaultPrefix

// membersPrefix is the directory of member keys: <prefix>/members/.
func membersPrefix(prefix string) string { return coordination.MembersPrefix(prefix) }

// memberKey is where apiserver id publishes its MemberState.
func memberKey(prefix, id string) string { return coordination.Member(prefix, id) }

// migrationStateKey holds the leader's MigrationState: records and progress.
func migrationStateKey(prefix string) string { return coordination.MigrationState(prefix) }
