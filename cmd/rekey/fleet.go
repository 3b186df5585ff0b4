package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	clientv3 "go.etcd.io/etcd/client/v3"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/rekey-io/rekey/api/v1alpha1"
	"github.com/rekey-io/rekey/internal/errtext"
	"github.com/rekey-io/rekey/internal/fleet"
	"github.com/rekey-io/rekey/internal/progress"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/layer"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/storagelayout"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// errFleetAttention makes `rekey fleet status` exit 3 (exitCodeAttention) after printing.
var errFleetAttention = errors.New("clusters need attention")

// exitCodeAttention is the exit code of `rekey fleet status` when a cluster needs
// attention or could not be read; 1 stays for "the command itself failed".
const exitCodeAttention = 3

func newFleetCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "fleet",
		Short: "Views of many clusters at once",
	}
	cmd.AddCommand(newFleetStatusCommand())
	return cmd
}

func newFleetStatusCommand() *cobra.Command {
	var file string
	var output outputFormat
	var concurrency int
	var timeout, alarm time.Duration
	mode := progress.NewFlag(progress.Auto, progress.Bar, progress.Plain, progress.None)
	cmd := &cobra.Command{
		Use:   "status -f FLEET.yaml",
		Short: "One row per cluster: write key age, objects not on the write key, plaintext, stragglers, budget, FIPS",
		Long: `fleet status reads every cluster of a fleet file, a bounded number at once, and
prints one row per cluster. An entry is an etcd (endpoints and TLS files) and the
prefixes one control plane stores under, so many control planes on one etcd under
different prefixes (Kamaji) are many entries; clusters on one etcd with the same TLS
share one client:

  concurrency: 8
  clusters:
    - name: tenant-a
      etcdServers: [https://etcd-0:2379]
      etcdCAFile: ca.crt
      etcdCertFile: client.crt
      etcdKeyFile: client.key
      etcdPrefix: /tenant-a/registry        # default /registry
      coordinationPrefix: /tenant-a/rekey   # default: derived from etcdPrefix
    - name: prod-eu                         # through its apiservers, no etcd access:
      kubeconfig: prod-eu.kubeconfig        # reads rekey.io/v1alpha1 encryptionstates/cluster
      context: admin                        # default: the kubeconfig's current context

For each cluster it reads the live apiservers' member records (the keys they write
and read, configuration hash, FIPS mode), then inventories, at one etcd revision and
without decrypting or calling a plugin, the resources their rules name, classified
by the rules of the apiservers on the most common configuration; and the cluster's
key-write totals (write key age; the share of an aesgcm key's 2^32-write budget used).

A row needs attention when objects are stored in plaintext (where a key writes, or
because the rule writes identity), objects are
not on their write key (stale or unreadable, unless acknowledged), an apiserver runs
another configuration or the apiservers have not converged, no apiserver publishes
its keys, an aesgcm key used half its budget, or the cluster could not be read. Rows
needing attention come first; the exit code is 3 when any row needs attention, 0
otherwise (1: the command failed).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if file == "" {
				return errors.New("-f is required: the fleet file (clusters: [{name, etcdServers, etcdPrefix}, ...])")
			}
			f, err := fleet.Load(file)
			if err != nil {
				return err
			}
			if concurrency > 0 {
				f.Concurrency = concurrency
			}
			start := time.Now()
			p := progress.New(cmd.ErrOrStderr(), mode.Mode())
			rows := readFleet(cmd.Context(), f, timeout, alarm, p)
			p.Done()
			fleet.Sort(rows)
			attention := 0
			for _, r := range rows {
				if r.NeedsAttention() {
					attention++
				}
			}
			if err := output.write(cmd.OutOrStdout(), rows, func(w io.Writer) {
				writeFleetTable(w, rows)
				printLine(w, "%d clusters read in %s, %d need attention", len(rows), time.Since(start).Round(time.Millisecond), attention)
			}); err != nil {
				return err
			}
			if attention > 0 {
				return &exitError{code: exitCodeAttention, err: fmt.Errorf("%w: %d of %d", errFleetAttention, attention, len(rows))}
			}
			return nil
		},
	}
	cmd.Flags().StringVarP(&file, "file", "f", "", "The fleet file. Required.")
	cmd.Flags().IntVar(&concurrency, "concurrency", 0, "Clusters read at once (default: the file's concurrency, else 8).")
	cmd.Flags().DurationVar(&timeout, "cluster-timeout", time.Minute, "How long reading one cluster may take.")
	cmd.Flags().DurationVar(&alarm, "disagreement-alarm", cluster.DefaultDisagreementAlarm, "Report an alarm when a member has seen the others disagree for longer than this.")
	cmd.Flags().Var(mode, "progress", "How progress is shown on stderr: auto (a bar on a terminal, else plain), bar (one line redrawn), plain (a line per tenth of the fleet) or none.")
	addOutputFlag(cmd.Flags(), &output)
	return cmd
}

// exitError is an error with its own exit code (main's exit code for it).
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// readFleet reads every cluster, at most f.Concurrency at once; clusters on one etcd
// with the same TLS files share one client. Progress: a bar redrawn at each cluster, a
// line per tenth of the fleet, and a line for each cluster that could not be read.
func readFleet(ctx context.Context, f *fleet.File, timeout, alarm time.Duration, p *progress.Writer) []fleet.Row {
	clients := &clientPool{clients: map[string]*pooledClient{}}
	defer clients.close()
	rows := make([]fleet.Row, len(f.Clusters))
	sem := make(chan struct{}, f.Concurrency)
	var wg sync.WaitGroup
	var mu sync.Mutex
	done := 0
	step := max(1, len(f.Clusters)/10)
	for i, c := range f.Clusters {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			cctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			row, err := readCluster(cctx, clients, c, alarm)
			if err != nil {
				row = fleet.Row{Name: c.Name, BudgetUsed: -1, Error: err.Error(), Attention: []string{"not read: " + err.Error()}}
			}
			rows[i] = row
			mu.Lock()
			defer mu.Unlock()
			done++
			if err != nil {
				p.Line(errtext.Printable(fmt.Sprintf("fleet: %s not read: %v", c.Name, err)))
			}
			frac := float64(done) / float64(len(f.Clusters))
			status := fmt.Sprintf("fleet %s %d/%d clusters read", progress.Fill(frac, 30), done, len(f.Clusters))
			if p.Mode() == progress.Bar {
				p.Status(status, done == len(f.Clusters))
			} else if done%step == 0 || done == len(f.Clusters) {
				p.Line(fmt.Sprintf("fleet: %d/%d clusters read", done, len(f.Clusters)))
			}
		}()
	}
	wg.Wait()
	return rows
}

// readCluster reads one cluster's members, inventory and key-write totals from its
// etcd, or its EncryptionState through its apiservers (an entry with a kubeconfig).
func readCluster(ctx context.Context, clients *clientPool, c fleet.Cluster, alarm time.Duration) (fleet.Row, error) {
	if c.Kubeconfig != "" {
		return readClusterAPI(ctx, c)
	}
	cli, err := clients.get(ctx, layer.Etcd{Servers: c.EtcdServers, CAFile: c.EtcdCAFile, CertFile: c.EtcdCertFile, KeyFile: c.EtcdKeyFile})
	if err != nil {
		return fleet.Row{}, err
	}
	coord := c.CoordinationPrefix
	if coord == "" {
		coord = layer.DefaultCoordinationPrefix(c.EtcdPrefix)
	}
	snap, err := cluster.ReadSnapshot(ctx, cli, coord)
	if err != nil {
		return fleet.Row{}, err
	}
	rules := fleet.Rules(snap.Members)
	var names []string
	seen := map[string]bool{}
	for _, r := range rules {
		if !seen[r.Resource] {
			seen[r.Resource] = true
			names = append(names, r.Resource)
		}
	}
	if len(names) == 0 {
		names = []string{"secrets", "configmaps"}
	}
	layout := storagelayout.Kube(c.EtcdPrefix)
	res, err := (&migrate.Resolver{Client: cli, Layout: layout, Skip: []string{coord}}).Resolve(ctx, names)
	if err != nil {
		return fleet.Row{}, err
	}
	head, err := cli.Get(ctx, "health", clientv3.WithCountOnly())
	if err != nil {
		return fleet.Row{}, err
	}
	inv, err := migrate.TakeInventory(ctx, migrate.InventoryOptions{
		Client: cli, Source: migrate.FromRules(noTransformers{}, func() []transformers.RuleInfo { return rules }),
		Resources: res.Resources, Wildcards: res.Wildcards, Revision: head.Header.Revision, CoordinationPrefix: coord,
	})
	if err != nil {
		return fleet.Row{}, err
	}
	totals, err := cluster.ReadKeyTotals(ctx, cli, coord)
	if err != nil {
		return fleet.Row{}, err
	}
	return fleet.Summarize(c.Name, snap, inv, totals, time.Now(), alarm), nil
}

// noTransformers serves no transformer: a fleet inventory never decrypts (no decrypt
// check; it holds no key), it classifies by stored prefix and KMS key id alone.
type noTransformers struct{}

func (noTransformers) TransformerForResource(schema.GroupResource) value.Transformer { return nil }

// clientPool shares one etcd client among the clusters of one etcd and TLS files.
type clientPool struct {
	mu      sync.Mutex
	clients map[string]*pooledClient
}

type pooledClient struct {
	once sync.Once
	cli  *clientv3.Client
	err  error
}

func (p *clientPool) get(ctx context.Context, e layer.Etcd) (*clientv3.Client, error) {
	key := strings.Join(e.Servers, ",") + "\x00" + e.CAFile + "\x00" + e.CertFile + "\x00" + e.KeyFile
	p.mu.Lock()
	pc := p.clients[key]
	if pc == nil {
		pc = &pooledClient{}
		p.clients[key] = pc
	}
	p.mu.Unlock()
	pc.once.Do(func() {
		c := common{etcd: e, timeout: 10 * time.Second}
		pc.cli, pc.err = c.client(ctx)
	})
	return pc.cli, pc.err
}

func (p *clientPool) close() {
	for _, pc := range p.clients {
		if pc.cli != nil {
			_ = pc.cli.Close()
		}
	}
}

// writeFleetTable renders the rows: names and keys come from the fleet file and etcd,
// so through row and printLine only.
func writeFleetTable(w io.Writer, rows []fleet.Row) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	row(tw, "CLUSTER", "APISERVERS", "WRITE KEY", "KEY AGE", "OBJECTS", "NOT ON WRITE KEY", "PLAINTEXT", "STRAGGLERS", "BUDGET", "FIPS", "ATTENTION")
	for _, r := range rows {
		age, budget := "-", "-"
		if r.WriteKeyAge > 0 {
			age = r.WriteKeyAge.Round(time.Second).String()
		}
		if r.BudgetUsed >= 0 {
			budget = fmt.Sprintf("%.2g%%", 100*r.BudgetUsed)
		}
		row(tw, r.Name, fmt.Sprint(r.APIServers), dash(r.WriteKey), age, fmt.Sprint(r.Objects), fmt.Sprint(r.NotOnWriteKey),
			fmt.Sprint(r.Plaintext), fmt.Sprint(r.Stragglers), budget, dash(r.FIPS), dash(strings.Join(r.Attention, "; ")))
	}
	_ = tw.Flush()
}

// readClusterAPI reads a cluster's rekey.io/v1alpha1 EncryptionState with the entry's
// kubeconfig and context: one GET, no etcd access (docs/encryption-state.md).
func readClusterAPI(ctx context.Context, c fleet.Cluster) (fleet.Row, error) {
	rules := &clientcmd.ClientConfigLoadingRules{ExplicitPath: c.Kubeconfig}
	rc, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: c.Context}).ClientConfig()
	if err != nil {
		return fleet.Row{}, fmt.Errorf("kubeconfig %s: %w", c.Kubeconfig, err)
	}
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		return fleet.Row{}, fmt.Errorf("kubeconfig %s: %w", c.Kubeconfig, err)
	}
	u, err := dyn.Resource(v1alpha1.EncryptionStateGroupVersionResource()).Get(ctx, v1alpha1.EncryptionStateName, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return fleet.Row{}, fmt.Errorf("%s has no %s/%s: are its apiservers rekey's (a distribution or the shim) with a migration leader?",
			rc.Host, v1alpha1.EncryptionStateResource, v1alpha1.EncryptionStateName)
	case err != nil:
		return fleet.Row{}, fmt.Errorf("reading %s/%s from %s: %w", v1alpha1.EncryptionStateResource, v1alpha1.EncryptionStateName, rc.Host, err)
	}
	var st v1alpha1.EncryptionState
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &st); err != nil {
		return fleet.Row{}, fmt.Errorf("%s/%s from %s does not decode: %w", v1alpha1.EncryptionStateResource, v1alpha1.EncryptionStateName, rc.Host, err)
	}
	return fleet.SummarizeState(c.Name, &st, time.Now()), nil
}
