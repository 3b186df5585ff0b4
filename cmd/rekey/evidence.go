package main

import (
	"crypto/fips140"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/atomicfile"
	"github.com/rekey-io/rekey/internal/evidence"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/keyledger"
	"github.com/rekey-io/rekey/pkg/migrate"
)

func newEvidenceCommand() *cobra.Command {
	var c common
	var prefix, signingKey, out string
	var decrypt bool
	cmd := &cobra.Command{
		Use:   "evidence",
		Short: "Sign evidence of what etcd holds per key: an in-toto Statement in a DSSE envelope",
		Long: `evidence takes a fresh inventory of the stored objects, every resource at one etcd
revision, and signs what it found with an operator's key: per resource, the objects
under each key (by fingerprint: provider/name and check value, or the KMS v2 key id
hash; never key material), in plaintext, unreadable (a key the configuration lacks,
a retired key among them) and stale; the cluster identity, the revision and time;
every live apiserver's configuration hash; the rekey version and whether it runs in
FIPS 140-3 mode. It is written as an in-toto v1 Statement (predicate type
` + evidence.PredicateType + `) in a DSSE envelope, signed with --signing-key
(a PKCS#8 PEM ed25519 or ECDSA P-256 key); the subject is the cluster id with the
sha256 of the predicate. rekey evidence verify checks it offline.

What needs attention (plaintext, also where the rule writes identity; unreadable; stale; an apiserver
on another configuration) is printed on stderr; the exit code is 0 whenever the
evidence was written.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if signingKey == "" {
				return errors.New("--signing-key is required: a PKCS#8 PEM ed25519 or ECDSA P-256 private key (openssl genpkey -algorithm ed25519 -out key.pem)")
			}
			keyPEM, err := os.ReadFile(signingKey)
			if err != nil {
				return fmt.Errorf("--signing-key: %w", err)
			}
			key, err := evidence.ParsePrivateKey(keyPEM)
			if err != nil {
				return fmt.Errorf("--signing-key %s: %w", signingKey, err)
			}
			ctx := cmd.Context()
			s, err := c.open(ctx, preamble{config: true})
			if err != nil {
				return err
			}
			defer s.Close()
			coord := c.coordinationPrefix(prefix)
			c.acknowledgedUnder = coord
			head, err := s.etcd.Get(ctx, "health", clientv3.WithCountOnly())
			if err != nil {
				return fmt.Errorf("reading etcd's revision: %w", err)
			}
			rev := head.Header.Revision
			res, err := c.resolve(ctx, s.etcd, s.cur.cfg)
			if err != nil {
				return err
			}
			opts := c.inventoryOptions(s.etcd, s.cur, decrypt, res)
			opts.Revision = rev
			inv, err := migrate.TakeInventory(ctx, opts)
			if err != nil {
				return err
			}
			snap, err := cluster.ReadSnapshot(ctx, s.etcd, coord)
			if err != nil {
				return err
			}
			ledger, _, _, err := keyledger.Store{Client: s.etcd, Key: keyledger.Key(coord)}.Load(ctx)
			if err != nil {
				return err
			}
			id := evidence.Cluster{EtcdPrefix: c.etcdPrefix, CoordinationPrefix: coord}
			if snap.Identity != nil {
				id.ID = snap.Identity.ClusterID
			}
			pred, err := evidence.Build(evidence.Input{
				Cluster: id, Revision: rev, TakenAt: inv.TakenAt, RekeyVersion: rekeyVersion(), FIPS: fips140.Enabled(),
				Config: s.cur.cfg, Inventory: inv, Members: snap.Members, Ledger: ledger,
			})
			if err != nil {
				return err
			}
			env, err := evidence.Sign(ctx, pred, key)
			if err != nil {
				return fmt.Errorf("signing the evidence: %w", err)
			}
			if out == "" || out == "-" {
				if _, err := cmd.OutOrStdout().Write(env); err != nil {
					return err
				}
			} else if err := atomicfile.WriteFile(out, env, 0o644); err != nil {
				return fmt.Errorf("writing %s: %w", out, err)
			}
			w := cmd.ErrOrStderr()
			if id.ID == "" {
				printLine(w, "WARNING: no cluster identity at %s: no apiserver coordinated under it; the subject is %q", coord, evidence.SubjectName(id))
			}
			writeEvidenceSummary(w, pred)
			return nil
		},
	}
	c.addFlags(cmd.Flags())
	addCoordinationPrefixFlag(cmd.Flags(), &prefix)
	cmd.Flags().StringVar(&signingKey, "signing-key", "", "PKCS#8 PEM private key (ed25519 or ECDSA P-256) that signs the evidence. Required.")
	cmd.Flags().StringVar(&out, "out", "-", "Where to write the signed envelope (- for stdout).")
	cmd.Flags().BoolVar(&decrypt, "decrypt-check", false, "Also decrypt every value (KMS v2: calls the plugin for each DEK not cached) to count unreadable objects exactly.")
	cmd.AddCommand(newEvidenceVerifyCommand())
	return cmd
}

func newEvidenceVerifyCommand() *cobra.Command {
	var publicKey string
	var output outputFormat
	cmd := &cobra.Command{
		Use:   "verify --public-key PEM FILE",
		Short: "Check signed evidence offline and print the verdict and what it holds",
		Long: `verify checks a file rekey evidence wrote, offline: the DSSE signature with
--public-key (PKIX PEM, ed25519 or ECDSA P-256), the in-toto Statement and its
predicate type, the subject's sha256 against the predicate, and that no byte of the
file changed. It prints VERIFIED and a summary, or FAILED and why (exit 1).`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if publicKey == "" {
				return errors.New("--public-key is required: the PEM public key of the signing key (openssl pkey -pubout -in key.pem)")
			}
			pemData, err := os.ReadFile(publicKey)
			if err != nil {
				return fmt.Errorf("--public-key: %w", err)
			}
			pub, err := evidence.ParsePublicKey(pemData)
			if err != nil {
				return fmt.Errorf("--public-key %s: %w", publicKey, err)
			}
			file, err := os.ReadFile(args[0])
			if err != nil {
				return err
			}
			v, err := evidence.Verify(cmd.Context(), file, pub)
			if err != nil {
				fmt.Fprintln(cmd.OutOrStdout(), "FAILED")
				return fmt.Errorf("%s does not verify: %w", args[0], err)
			}
			return output.write(cmd.OutOrStdout(), v.Predicate, func(w io.Writer) {
				printLine(w, "VERIFIED signed by %s: subject %s sha256:%s", v.KeyID, v.Subject, v.Digest)
				writeEvidenceSummary(w, v.Predicate)
			})
		},
	}
	cmd.Flags().StringVar(&publicKey, "public-key", "", "PKIX PEM public key the evidence must be signed with. Required.")
	addOutputFlag(cmd.Flags(), &output)
	return cmd
}

// writeEvidenceSummary prints a predicate for people: names, hashes and counts read
// from etcd, so through row and printLine only.
func writeEvidenceSummary(w io.Writer, p *evidence.Predicate) {
	printLine(w, "cluster %s (etcd prefix %s) at revision %d, %s; rekey %s, FIPS mode %s; configuration %s",
		dash(p.Cluster.ID), p.Cluster.EtcdPrefix, p.Revision, p.TakenAt.Format(time.RFC3339), p.RekeyVersion, onOff(p.FIPS), p.ConfigHash)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	row(tw, "RESOURCE", "KEY", "OBJECTS", "UNREADABLE")
	for _, r := range p.Resources {
		for _, k := range r.Keys {
			key := k.Fingerprint
			if k.Current {
				key += " (writes)"
			}
			if k.LedgerCheck != "" {
				key += " ledger check:" + k.LedgerCheck
			}
			if k.Retired != nil {
				key += " retired " + k.Retired.Format(time.RFC3339)
			}
			row(tw, r.Resource, key, fmt.Sprint(k.Objects), fmt.Sprint(k.Unreadable))
		}
	}
	_ = tw.Flush()
	for _, a := range p.APIServers {
		same := "same configuration"
		if !a.SameConfig {
			same = "ANOTHER configuration"
		}
		fips := "FIPS unknown"
		if a.FIPS != nil {
			fips = "FIPS " + onOff(*a.FIPS)
		}
		printLine(w, "apiserver %s: %s (%s), %s", a.ID, a.ConfigHash, same, fips)
	}
	t := p.Totals
	printLine(w, "%d objects: %d plaintext, %d stale, %d unreadable (%d acknowledged); %d not on their write key", t.Objects, t.Plaintext, t.Stale, t.Unreadable, t.Acknowledged, t.NotOnWriteKey)
	for _, a := range p.NeedsAttention() {
		printLine(w, "ATTENTION %s", a)
	}
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

// rekeyVersion is this build's module version and VCS revision when known.
func rekeyVersion() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "(unknown)"
	}
	v := bi.Main.Version
	if v == "" {
		v = "(devel)"
	}
	for _, s := range bi.Settings {
		if s.Key == "vcs.revision" {
			v += "+" + s.Value
		}
	}
	return v
}
