// Command rekey is the operator CLI of the rekey encryption-at-rest layer.
//
//	rekey inventory    --etcd-servers URL --encryption-provider-config FILE [-o table|json] [--decrypt-check]
//	rekey inventory    --snapshot FILE [--skip-hash-check] [--encryption-provider-config FILE] [--etcd-prefix /registry]
//	rekey migrate      --etcd-servers URL --encryption-provider-config FILE [--rate N] [--checkpoint PATH] [--resume] [--progress auto|bar|plain|none]
//	rekey check-config --etcd-servers URL --encryption-provider-config FILE --new FILE
//	rekey status       --etcd-servers URL [--coordination-prefix /rekey] [-o table|json]
//	rekey ledger       --etcd-servers URL [--coordination-prefix /rekey] [-o table|json]
//	rekey rotate       --encryption-provider-config FILE [--provider aesgcm|secretbox|aescbc|kms] [-o -] [--remove-old NAME --etcd-servers URL]
//	rekey rotate       --encryption-provider-config FILE --wait --etcd-servers URL [--coordination-prefix /rekey] [--wait-timeout 30m] [--progress auto|bar|plain]
//	rekey evidence     --etcd-servers URL --encryption-provider-config FILE --signing-key PEM [--out FILE]
//	rekey evidence verify --public-key PEM FILE
//	rekey fleet status -f FLEET.yaml [--concurrency N] [-o table|json]   (exit 3: a cluster needs attention)
//	rekey kms-check    --endpoint unix:///PATH.sock | --plugin-command CMD [--observe 10s] [--calls N] [-o table|json]
//
// inventory counts stored objects per resource, provider, key (KMS: provider name and
// key id hash) and state; migrate re-encrypts every stale object with compare-and-swap
// and verifies the result; check-config refuses a new configuration that would drop a
// key still encrypting stored data. See docs/migration.md. status shows the apiservers
// that coordinate through etcd (docs/cluster.md); ledger lists every key the cluster wrote
// with and when it retired, what etcd backups need (--backup-retention keeps those keys).
// kms-check tells whether a KMS v2 plugin behaves as the contract says before it is
// trusted with data (exit 1 when a check fails).
package main

import (
	"errors"
	"os"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
)

func main() {
	os.Exit(execute(newRootCommand()))
}

// execute is cli.Run, except that a command failing with an *exitError exits with its
// code (rekey fleet status: 3 when a cluster needs attention).
func execute(root *cobra.Command) int {
	var coded *exitError
	var keep func(c *cobra.Command)
	keep = func(c *cobra.Command) {
		if run := c.RunE; run != nil {
			c.RunE = func(cmd *cobra.Command, args []string) error {
				err := run(cmd, args)
				errors.As(err, &coded)
				return err
			}
		}
		for _, sub := range c.Commands() {
			keep(sub)
		}
	}
	keep(root)
	code := cli.Run(root)
	if code != 0 && coded != nil {
		return coded.code
	}
	return code
}

func newRootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:           "rekey",
		Short:         "Inventory, migrate and guard data encrypted at rest in a Kubernetes etcd",
		SilenceUsage:  true,
		SilenceErrors: false,
	}
	root.AddCommand(newInventoryCommand(), newMigrateCommand(), newCheckConfigCommand(), newStatusCommand(), newRotateCommand(), newLedgerCommand(), newKMSCheckCommand(), newEvidenceCommand(), newFleetCommand())
	root.AddCommand(newControllerCommand())
	printableErrors(root)
	return root
}
