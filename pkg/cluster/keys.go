package cluster

import (
	"fmt"
	"strings"
)

// DefaultPrefix is the default coordination prefix (--coordination-prefix).
const DefaultPrefix = "/rekey"

// The etcd keys under the coordination prefix.
const (
	membersDir      = "/members/"
	leaderPath      = "/migration/leader"
	checkpointPath  = "/migration/checkpoint"
	migrationKeyDir = "/migration/state"
	identityPath    = "/cluster"
)

// MembersPrefix is the directory of member keys: <prefix>/members/.
func MembersPrefix(prefix string) string { return prefix + membersDir }

// MemberKey is where apiserver id publishes its MemberState.
func MemberKey(prefix, id string) string { return prefix + membersDir + id }

// identityKey holds the cluster's Identity: its id and the --etcd-prefix it is bound to.
func identityKey(prefix string) string { return prefix + identityPath }

// leaderKey is the election prefix of the migration leader.
func leaderKey(prefix string) string { return prefix + leaderPath }

// checkpointKey holds the running migration's checkpoint (pkg/migrate's format).
func checkpointKey(prefix string) string { return prefix + checkpointPath }

// MigrationStateKey holds the leader's MigrationState: records and progress.
func MigrationStateKey(prefix string) string { return prefix + migrationKeyDir }

// ValidatePrefix checks a coordination prefix against the resource prefix
// (--etcd-prefix): it must be an absolute key path, and neither may contain the other,
// so coordination keys are never mistaken for stored objects (or migrated).
func ValidatePrefix(prefix, resourcePrefix string) error {
	if !strings.HasPrefix(prefix, "/") || strings.HasSuffix(prefix, "/") || len(prefix) < 2 {
		return fmt.Errorf("--coordination-prefix %q must start with / and not end with / (e.g. %s)", prefix, DefaultPrefix)
	}
	if overlaps(prefix, resourcePrefix) {
		// Suggest a prefix that works with this --etcd-prefix: the default itself can be
		// the one that collides (--etcd-prefix /rekey).
		suggest := DefaultPrefix
		if overlaps(suggest, resourcePrefix) {
			suggest = DefaultPrefix + "-coordination"
		}
		return fmt.Errorf("--coordination-prefix %q overlaps --etcd-prefix %q: choose one outside the resource prefix (e.g. %s)", prefix, resourcePrefix, suggest)
	}
	return nil
}

// overlaps reports whether one key prefix contains the other.
func overlaps(prefix, resourcePrefix string) bool {
	p, r := prefix+"/", strings.TrimSuffix(resourcePrefix, "/")+"/"
	return strings.HasPrefix(p, r) || strings.HasPrefix(r, p)
}

// ValidateID checks an apiserver id (--apiserver-id): it names an etcd key.
func ValidateID(id string) error {
	if id == "" || strings.ContainsAny(id, "/\x00") || len(id) > 253 {
		return fmt.Errorf("--apiserver-id %q must be 1 to 253 characters without / (e.g. host:port)", id)
	}
	return nil
}
