package migrate

import "github.com/rekey-io/rekey/pkg/storagelayout"

// The defaults and bounds of inventories and migrations, in one place for the flags
// that expose them (cmd/rekey, pkg/layer).
const (
	// DefaultEtcdPrefix is kube-apiserver's --etcd-prefix default.
	DefaultEtcdPrefix = storagelayout.DefaultEtcdPrefix
	// DefaultPageSize and DefaultPageBytes bound one etcd range request: a page stops
	// at that many objects or about that many bytes, whichever comes first (scan.go
	// says how the byte bound is kept).
	DefaultPageSize  = 500
	DefaultPageBytes = 8 << 20
	// DefaultBatchSize is how many rewrites share one etcd transaction (etcd allows
	// 128 operations per transaction by default).
	DefaultBatchSize = 64
	// DefaultBatchBytes bounds the size of one transaction (etcd's default request
	// limit is 1.5 MiB).
	DefaultBatchBytes = 1 << 20
	// DefaultMaxPasses bounds migrate-and-verify rounds.
	DefaultMaxPasses = 3
	// MaxUnreadableListed bounds how many unreadable objects one resource's inventory
	// names (ResourceInventory.UnreadableObjects); ResourceInventory.Unreadable still
	// counts them all, so an inventory of a million broken objects stays small.
	MaxUnreadableListed = 1000
	// DefaultAcknowledgedBy is who an acknowledgement is from when no apiserver id is
	// given (Acknowledger.By).
	DefaultAcknowledgedBy = "rekey-cli"
)
