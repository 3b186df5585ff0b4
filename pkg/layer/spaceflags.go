package layer

import (
	"fmt"

	"github.com/spf13/pflag"

	"github.com/rekey-io/rekey/pkg/migrate/pace"
)

// Flag names of a migration's space bounds: the layer and `rekey migrate` declare
// them with AddStorageMigrationSpaceFlags.
const (
	FlagStorageMigrationEtcdQuotaBytes = "storage-migration-etcd-quota-bytes"
	FlagStorageMigrationMaxDBFraction  = "storage-migration-max-db-fraction"
)

// AddStorageMigrationSpaceFlags declares the flags bounding how full a storage
// migration lets etcd's database get, with the current values as defaults.
func AddStorageMigrationSpaceFlags(fs *pflag.FlagSet, quotaBytes *int64, fraction *float64) {
	fs.Int64Var(quotaBytes, FlagStorageMigrationEtcdQuotaBytes, *quotaBytes,
		"The etcd members' --quota-backend-bytes (etcd's default: 2 GiB). etcd has no API that reports it, so say it here when it is not the default: "+
			"every rewrite adds a revision that only compaction frees, and at the quota etcd raises NOSPACE and refuses every write of the cluster.")
	fs.Float64Var(fraction, FlagStorageMigrationMaxDBFraction, *fraction,
		"Storage migration pauses before etcd's database (in use, as etcd's Status reports it) reaches this fraction of "+
			"--"+FlagStorageMigrationEtcdQuotaBytes+", and while a NOSPACE alarm is raised (status condition, rekey_storage_migration_paused, a log line); "+
			"it resumes once compaction (kube-apiserver's, every 5 minutes) or a defragmentation frees space. It never compacts or defragments itself.")
}

// ValidateStorageMigrationSpace checks the values of those flags.
func ValidateStorageMigrationSpace(quotaBytes int64, fraction float64) []error {
	var errs []error
	if quotaBytes < 0 {
		errs = append(errs, fmt.Errorf("--%s=%d: must be the etcd members' --quota-backend-bytes (0: etcd's default, %d)", FlagStorageMigrationEtcdQuotaBytes, quotaBytes, int64(pace.DefaultEtcdQuotaBytes)))
	}
	if fraction < 0 || fraction > 1 {
		errs = append(errs, fmt.Errorf("--%s=%v: must be above 0 and at most 1 (0: the default, %v)", FlagStorageMigrationMaxDBFraction, fraction, pace.DefaultMaxDBFraction))
	}
	return errs
}
