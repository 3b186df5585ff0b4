// Package coordination names every etcd key rekey keeps under the coordination prefix
// (--coordination-prefix), in one table (Keys), and builds each of them from the
// prefix. The packages that own the keys (pkg/cluster, pkg/guard, pkg/keyledger,
// pkg/migrate) build them here rather than spelling paths of their own, so that two
// owners cannot pick overlapping keys unnoticed (the package's tests check the table)
// and docs/cluster.md lists exactly these keys (a test compares it with the table).
//
// It imports nothing of this module: every package that touches the prefix may import it.
package coordination

// DefaultPrefix is the default coordination prefix (--coordination-prefix) for kube's
// /registry resource prefix.
const DefaultPrefix = "/rekey"

// The paths of the keys relative to the coordination prefix. A path ending in / is a
// directory of keys, one per id; the others are single keys (the migration leader is the
// prefix an etcd election writes its candidates under).
const (
	identityPath        = "/cluster"
	membersDir          = "/members/"
	migrationLeaderPath = "/migration/leader"
	checkpointPath      = "/migration/checkpoint"
	migrationStatePath  = "/migration/state"
	migrationClientsDir = "/migration/clients/"
	verifiedDir         = "/migration/verified/"
	keyWritesDir        = "/keywrites/"
	appliedStateDir     = "/applied/"
	ledgerPath          = "/ledger"
	acknowledgedDir     = "/acknowledged/"
)

// Lifetime says how long a key stays in etcd.
type Lifetime string

const (
	// Permanent keys stay until an operator deletes them; their writers rewrite them.
	Permanent Lifetime = "permanent"
	// Leased keys are deleted with their writer's lease: a dead apiserver's key goes
	// when the lease expires, a clean shutdown deletes it at once.
	Leased Lifetime = "leased"
	// UntilVoid keys are deleted once what they refer to changes (the next read that
	// notices removes them).
	UntilVoid Lifetime = "until void"
)

// Entry is one key, or one directory of keys, under the coordination prefix.
type Entry struct {
	// Name names the entry in the table and in errors.
	Name string
	// Path is the key relative to the prefix; ending in / it is a directory whose keys
	// end in ID.
	Path string
	// ID is the placeholder of what follows Path in each key of a directory (or, for an
	// election, the part the election appends), "" for a single key.
	ID string
	// Owner is the package that writes the key.
	Owner string
	// Holds says what the value is.
	Holds string
	// Lifetime says how long the key stays.
	Lifetime Lifetime
	// Within, when set, names the entry whose keys this one nests inside on purpose: the
	// overlap check accepts this one pair. None nests today.
	Within string
}

// Shape is the entry's keys as docs/cluster.md writes them: <prefix>/members/<apiserver-id>.
func (e Entry) Shape() string { return "<prefix>" + e.Path + e.ID }

// Keys is every key rekey keeps under the coordination prefix. It returns a new slice
// on each call, so no caller can change what the others see.
func Keys() []Entry {
	return []Entry{
		{Name: "identity", Path: identityPath, Owner: "pkg/cluster", Lifetime: Permanent,
			Holds: "the cluster's id and the --etcd-prefix it is bound to; created once, by the first apiserver"},
		{Name: "members", Path: membersDir, ID: "<apiserver-id>", Owner: "pkg/cluster", Lifetime: Leased,
			Holds: "one live apiserver's MemberState: config hash, write and read keys, KMS key ids"},
		{Name: "migration leader", Path: migrationLeaderPath, ID: "/<lease-id>", Owner: "pkg/cluster", Lifetime: Leased,
			Holds: "the etcd election of the migration leader; the value is the candidate's apiserver id"},
		{Name: "migration checkpoint", Path: checkpointPath, Owner: "pkg/cluster", Lifetime: Permanent,
			Holds: "the running migration's checkpoint (pkg/migrate's format), written by the leader only"},
		{Name: "migration state", Path: migrationStatePath, Owner: "pkg/cluster", Lifetime: Permanent,
			Holds: "the leader's MigrationState: migration records and progress"},
		{Name: "migration clients", Path: migrationClientsDir, ID: "<apiserver-id>", Owner: "pkg/cluster", Lifetime: Leased,
			Holds: "while a migration runs, a follower's latest report of its clients' request latencies (and their baseline) for the leader's pacing"},
		{Name: "verified inventory", Path: verifiedDir, ID: "<resource>", Owner: "pkg/cluster", Lifetime: Permanent,
			Holds: "the leader's verifying re-scan of a resource's last migration (pkg/migrate's inventory, with the record's revision), which followers with the same configuration adopt instead of reading every object again"},
		{Name: "key writes", Path: keyWritesDir, ID: "<key-hash>", Owner: "pkg/cluster", Lifetime: Permanent,
			Holds: "one key's lifetime count of values sealed and when it was first seen"},
		{Name: "applied state", Path: appliedStateDir, ID: "<encryption-state-id>", Owner: "pkg/guard", Lifetime: Permanent,
			Holds: "what the last configuration an apiserver applied could read (the start-up check)"},
		{Name: "key ledger", Path: ledgerPath, Owner: "pkg/keyledger", Lifetime: Permanent,
			Holds: "every key and KMS v2 key id the cluster wrote with, and its retirement"},
		{Name: "acknowledgements", Path: acknowledgedDir, ID: "<resource>/[<namespace>/]<name>", Owner: "pkg/migrate", Lifetime: UntilVoid,
			Holds: "an operator's acknowledgement that one stored value is unreadable; void once the object is rewritten"},
	}
}

// Identity is the key of the cluster's identity.
func Identity(prefix string) string { return prefix + identityPath }

// MembersPrefix is the directory of member keys: <prefix>/members/.
func MembersPrefix(prefix string) string { return prefix + membersDir }

// Member is where apiserver id publishes its MemberState.
func Member(prefix, id string) string { return MembersPrefix(prefix) + id }

// MigrationLeader is the election prefix of the migration leader (the election adds
// /<lease-id> for each candidate).
func MigrationLeader(prefix string) string { return prefix + migrationLeaderPath }

// MigrationCheckpoint holds the running migration's checkpoint.
func MigrationCheckpoint(prefix string) string { return prefix + checkpointPath }

// MigrationState holds the leader's MigrationState.
func MigrationState(prefix string) string { return prefix + migrationStatePath }

// MigrationClients is where apiserver id reports its clients' latency while a
// migration another apiserver leads runs ("" id: the directory of them).
func MigrationClients(prefix, id string) string { return prefix + migrationClientsDir + id }

// MigrationVerified is the key of the leader's verifying re-scan of resource ("secrets",
// "widgets.example.com").
func MigrationVerified(prefix, resource string) string { return prefix + verifiedDir + resource }

// KeyWritesPrefix is the directory of the per-key write totals: <prefix>/keywrites/.
func KeyWritesPrefix(prefix string) string { return prefix + keyWritesDir }

// KeyWrites is where the total of the key whose identity hashes to keyHash lives.
func KeyWrites(prefix, keyHash string) string { return KeyWritesPrefix(prefix) + keyHash }

// AppliedState is where the applied state named stateID lives.
func AppliedState(prefix, stateID string) string { return prefix + appliedStateDir + stateID }

// LegacyAppliedStatePrefix is where apiservers kept their applied state before it moved
// under the coordination prefix: <LegacyAppliedStatePrefix><encryption-state-id>. It is
// spelled out rather than built from DefaultPrefix because the keys older versions wrote
// stay where they are whatever the default becomes; with today's default (/rekey) it is
// AppliedState's directory, which the package's tests pin.
const LegacyAppliedStatePrefix = "/rekey" + appliedStateDir

// Ledger is the key ledger's key.
func Ledger(prefix string) string { return prefix + ledgerPath }

// AcknowledgedPrefix is the directory of acknowledgements: <prefix>/acknowledged/.
func AcknowledgedPrefix(prefix string) string { return prefix + acknowledgedDir }

// Acknowledgement is where the acknowledgement of the object namespace/name of resource
// lives: <prefix>/acknowledged/<resource>/<namespace>/<name>, or without the namespace
// for a cluster-scoped object (namespace "").
func Acknowledgement(prefix, resource, namespace, name string) string {
	if namespace == "" {
		return AcknowledgedPrefix(prefix) + resource + "/" + name
	}
	return AcknowledgedPrefix(prefix) + resource + "/" + namespace + "/" + name
}
