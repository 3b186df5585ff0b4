// Command rekey-kms-pkcs11 is a KMS v2 plugin whose key-encryption keys are AES-256
// key objects on a PKCS#11 token, one per key version, and the tool that manages those
// versions: serve, rotate, list, retire VERSION, destroy VERSION. See README.md.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	kmsapi "k8s.io/kms/apis/v2"
	"k8s.io/kms/pkg/service"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/internal/kmsplugin"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/layer"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/plugins/kms-pkcs11/internal/inuse"
	"github.com/rekey-io/rekey/plugins/kms-pkcs11/internal/server"
	"github.com/rekey-io/rekey/plugins/kms-pkcs11/internal/token"
)

// DefaultModule is where Debian's softhsm2 package puts the library.
const DefaultModule = "/usr/lib/softhsm/libsofthsm2.so"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newRootCommand().ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "rekey-kms-pkcs11:", err)
		os.Exit(1)
	}
}

// tokenFlags say which token and key label every command opens.
type tokenFlags struct {
	module, tokenLabel, pinFile, keyLabel string
	maxSessions                           int
	sessionWait                           time.Duration
}

func (f *tokenFlags) add(fs *pflag.FlagSet) {
	fs.StringVar(&f.module, "module", DefaultModule, "Path of the PKCS#11 library (the HSM vendor's, or SoftHSM2's).")
	fs.StringVar(&f.tokenLabel, "token-label", "", "Label of the token holding the keys. Required.")
	fs.StringVar(&f.pinFile, "pin-file", "", "File holding the user PIN (one line; mode 0600 or stricter recommended). Required. The PIN is never logged, published or part of an error.")
	fs.StringVar(&f.keyLabel, "key-label", "rekey-kek", "CKA_LABEL of the key versions (the version is in CKA_ID); the KMS key id is <key-label>:v<version>.")
	fs.IntVar(&f.maxSessions, "max-sessions", token.DefaultMaxSessions, "Most PKCS#11 sessions open at once for sealing and opening (at least 2: one keeps the login); calls beyond it wait up to --session-wait.")
	fs.DurationVar(&f.sessionWait, "session-wait", token.DefaultSessionWait, "How long a call waits for a free session before it fails.")
}

func (f *tokenFlags) config() (token.Config, error) {
	if f.tokenLabel == "" {
		return token.Config{}, errors.New("--token-label is required")
	}
	if f.pinFile == "" {
		return token.Config{}, errors.New("--pin-file is required")
	}
	raw, err := os.ReadFile(f.pinFile)
	if err != nil {
		return token.Config{}, fmt.Errorf("reading --pin-file: %w", err)
	}
	pin := strings.TrimRight(string(raw), "\r\n")
	if pin == "" {
		return token.Config{}, fmt.Errorf("--pin-file %s is empty", f.pinFile)
	}
	return token.Config{Module: f.module, TokenLabel: f.tokenLabel, PIN: pin, KeyLabel: f.keyLabel, MaxSessions: f.maxSessions, SessionWait: f.sessionWait}, nil
}

func (f *tokenFlags) open() (*token.Token, error) {
	cfg, err := f.config()
	if err != nil {
		return nil, err
	}
	return token.Open(cfg)
}

func newRootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:           "rekey-kms-pkcs11",
		Short:         "A KMS v2 plugin on a PKCS#11 token: every key version decrypts in one process, versions are retired only when nothing needs them",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newServeCommand(), newRotateCommand(), newListCommand(), newLetGoCommand("retire"), newLetGoCommand("destroy"))
	return root
}

func newServeCommand() *cobra.Command {
	var tf tokenFlags
	var listen, metricsAddr string
	var loginRetry, probe, refresh, shutdown time.Duration
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Serve KMS v2 on a unix socket",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := tf.config()
			if err != nil {
				return err
			}
			log := logr.FromSlogHandler(slog.NewTextHandler(cmd.ErrOrStderr(), nil))
			return serve(cmd.Context(), serveOptions{
				token: cfg, config: tf.config, listen: listen, metricsAddr: metricsAddr, loginRetry: loginRetry, probe: probe,
				refresh: refresh, shutdown: shutdown, log: log,
			})
		},
	}
	tf.add(cmd.Flags())
	fs := cmd.Flags()
	fs.StringVar(&listen, "listen-addr", "", "gRPC socket: unix:///path.sock (its directory must be private: not a symlink, this user's or root's, not group- or world-writable) or unix:///@abstract-name (default "+kmsplugin.DefaultListenAddr()+", directory created 0700).")
	fs.StringVar(&metricsAddr, "metrics-addr", "", "host:port serving Prometheus metrics at /metrics (empty: none). Use a loopback or pod-local address.")
	fs.DurationVar(&loginRetry, "login-retry-interval", server.DefaultLoginRetryInterval, "Least time between two login attempts after a failed one (a wrong PIN): one attempt per interval, so the token's PIN counter is never run down.")
	fs.DurationVar(&probe, "health-probe-interval", server.DefaultProbeInterval, "How often a seal/open probe of 32 bytes with the current version runs; Status reports its cached result.")
	fs.DurationVar(&refresh, "state-refresh-interval", server.DefaultRefreshInterval, "How often the versions on the token are read again: a version retired by the retire command stops decrypting within it. Status reads the current version on every call.")
	fs.DurationVar(&shutdown, "shutdown-timeout", 10*time.Second, "On SIGTERM, how long calls in flight may finish before the socket closes.")
	return cmd
}

type serveOptions struct {
	token token.Config
	// config reads the flags and the PIN file again: every login attempt reads the PIN
	// file, so a corrected PIN takes effect at the next attempt without a restart.
	config                               func() (token.Config, error)
	listen, metricsAddr                  string
	loginRetry, probe, refresh, shutdown time.Duration
	log                                  logr.Logger
}

func serve(ctx context.Context, o serveOptions) error {
	addr, err := kmsplugin.CheckListenAddr(o.listen)
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	svc, err := server.New(server.Options{
		Open: func() (*token.Token, error) {
			cfg, err := o.config()
			if err != nil {
				return nil, err
			}
			return token.Open(cfg)
		},
		KeyLabel:           o.token.KeyLabel,
		LoginRetryInterval: o.loginRetry,
		ProbeInterval:      o.probe,
		RefreshInterval:    o.refresh,
		Logger:             o.log,
		Registry:           reg,
	})
	if err != nil {
		return err
	}
	defer svc.Close()
	lis, err := kmsplugin.ListenUnix(addr)
	if err != nil {
		return err
	}
	gs := grpc.NewServer()
	kmsapi.RegisterKeyManagementServiceServer(gs, service.NewGRPCService(addr, 0, svc))
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	loopDone := make(chan struct{})
	go func() { defer close(loopDone); svc.Run(runCtx, clock.RealClock{}) }()
	var metricsSrv *http.Server
	if o.metricsAddr != "" {
		ml, err := net.Listen("tcp", o.metricsAddr)
		if err != nil {
			gs.Stop()
			return fmt.Errorf("--metrics-addr %s: %w", o.metricsAddr, err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		metricsSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = metricsSrv.Serve(ml) }()
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- gs.Serve(lis) }()
	o.log.Info("serving KMS v2", "socket", addr, "keyLabel", o.token.KeyLabel, "token", o.token.TokenLabel)
	select {
	case err := <-serveErr:
		cancel()
		<-loopDone
		return fmt.Errorf("gRPC server stopped: %w", err)
	case <-ctx.Done():
	}
	o.log.Info("shutting down: finishing calls in flight", "timeout", o.shutdown)
	stopped := make(chan struct{})
	go func() { gs.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(o.shutdown):
		gs.Stop()
	}
	if metricsSrv != nil {
		sctx, scancel := context.WithTimeout(context.Background(), time.Second)
		_ = metricsSrv.Shutdown(sctx)
		scancel()
	}
	cancel()
	<-loopDone
	return nil
}

func newRotateCommand() *cobra.Command {
	var tf tokenFlags
	cmd := &cobra.Command{
		Use:   "rotate",
		Short: "Create the next key version and make it current (the running plugin reports it in its next Status)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			tok, err := tf.open()
			if err != nil {
				return err
			}
			defer tok.Close()
			v, err := tok.Rotate(time.Now())
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "version %d is current: key id %s\n", v.Number, inuse.HashKeyID(v.KeyID))
			return nil
		},
	}
	tf.add(cmd.Flags())
	return cmd
}

func newListCommand() *cobra.Command {
	var tf tokenFlags
	var output string
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List the key versions on the token with their creation time and state (current, active, retired)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			tok, err := tf.open()
			if err != nil {
				return err
			}
			defer tok.Close()
			vs, err := tok.Versions()
			if err != nil {
				return err
			}
			highest, err := tok.Highest()
			if err != nil {
				return err
			}
			switch output {
			case "table":
				writeVersions(cmd.OutOrStdout(), vs, highest)
				return nil
			case "json":
				return writeVersionsJSON(cmd.OutOrStdout(), vs, highest)
			}
			return fmt.Errorf("-o %q: use table or json", output)
		},
	}
	tf.add(cmd.Flags())
	cmd.Flags().StringVarP(&output, "output", "o", "table", "table or json")
	return cmd
}

// versionJSON is one version as list -o json prints it.
type versionJSON struct {
	Version   uint64     `json:"version"`
	KeyIDHash string     `json:"keyIDHash"`
	Created   *time.Time `json:"created,omitempty"`
	State     string     `json:"state"`
	Retired   *time.Time `json:"retired,omitempty"`
}

func writeVersionsJSON(w io.Writer, vs []token.Version, highest uint64) error {
	doc := struct {
		Versions []versionJSON `json:"versions"`
		Highest  uint64        `json:"highestIssued"`
	}{Versions: []versionJSON{}, Highest: highest}
	for _, v := range vs {
		j := versionJSON{Version: v.Number, KeyIDHash: inuse.HashKeyID(v.KeyID), State: string(v.State)}
		if !v.Created.IsZero() {
			j.Created = &v.Created
		}
		if !v.RetiredAt.IsZero() {
			j.Retired = &v.RetiredAt
		}
		doc.Versions = append(doc.Versions, j)
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(doc)
}

func writeVersions(w io.Writer, vs []token.Version, highest uint64) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VERSION\tKEY ID HASH\tCREATED\tSTATE\tRETIRED")
	for _, v := range vs {
		created, retired := "-", "-"
		if !v.Created.IsZero() {
			created = v.Created.UTC().Format(time.RFC3339)
		}
		if !v.RetiredAt.IsZero() {
			retired = v.RetiredAt.UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\n", v.Number, inuse.HashKeyID(v.KeyID), created, v.State, retired)
	}
	_ = tw.Flush()
	fmt.Fprintf(w, "highest version issued: %d (never issued again)\n", highest)
}

// clusterFlags say how to reach the cluster's records, spelled as rekey's CLI spells
// them.
type clusterFlags struct {
	etcd               layer.Etcd
	dialTimeout        time.Duration
	etcdPrefix         string
	coordinationPrefix string
	retention          time.Duration
	override           bool
}

func (c *clusterFlags) add(fs *pflag.FlagSet) {
	fs.StringSliceVar(&c.etcd.Servers, "etcd-servers", nil, "etcd servers of the cluster whose apiservers use this plugin (scheme://ip:port), comma separated. Required: the check that nothing needs the version reads etcd.")
	fs.StringVar(&c.etcd.CAFile, "etcd-cafile", "", "SSL Certificate Authority file used to secure etcd communication.")
	fs.StringVar(&c.etcd.CertFile, "etcd-certfile", "", "SSL certification file used to secure etcd communication.")
	fs.StringVar(&c.etcd.KeyFile, "etcd-keyfile", "", "SSL key file used to secure etcd communication.")
	fs.DurationVar(&c.dialTimeout, "etcd-dial-timeout", 10*time.Second, "How long to wait for etcd to answer.")
	fs.StringVar(&c.etcdPrefix, "etcd-prefix", migrate.DefaultEtcdPrefix, "The prefix of all resource paths in etcd (kube-apiserver's --etcd-prefix).")
	fs.StringVar(&c.coordinationPrefix, "coordination-prefix", "", "The apiservers' --coordination-prefix. Default: the apiservers' default for --etcd-prefix.")
	fs.DurationVar(&c.retention, guard.BackupRetentionFlag, 0, "How long etcd snapshots are kept (e.g. 168h): refuse while a snapshot within it may hold values under the version, per the key ledger. The largest of this and what the apiservers publish is checked.")
	fs.BoolVar(&c.override, guard.OverrideFlag, false, "Let the version go even though the cluster still needs it (disaster recovery: the data under it becomes unreadable).")
}

func newLetGoCommand(action string) *cobra.Command {
	var tf tokenFlags
	var cf clusterFlags
	short := map[string]string{
		"retire":  "Stop a key version from decrypting (CKA_DECRYPT false); refused while stored objects, retained backups or live apiservers need it",
		"destroy": "Delete a retired key version's key object; refused while stored objects, retained backups or live apiservers need it",
	}[action]
	cmd := &cobra.Command{
		Use:   action + " VERSION",
		Short: short,
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			n, err := strconv.ParseUint(args[0], 10, 64)
			if err != nil || n == 0 {
				return fmt.Errorf("VERSION %q is not a version number (list shows them)", args[0])
			}
			tok, err := tf.open()
			if err != nil {
				return err
			}
			defer tok.Close()
			keyID := token.KeyID(tf.keyLabel, n)
			if err := checkInUse(cmd, &cf, action, n, keyID); err != nil {
				return err
			}
			now := time.Now()
			if action == "retire" {
				err = tok.Retire(n, now)
			} else {
				err = tok.Destroy(n)
			}
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "version %d (%s): %sd\n", n, inuse.HashKeyID(keyID), action)
			return nil
		},
	}
	tf.add(cmd.Flags())
	cf.add(cmd.Flags())
	return cmd
}

func checkInUse(cmd *cobra.Command, cf *clusterFlags, action string, n uint64, keyID string) error {
	ctx := cmd.Context()
	if len(cf.etcd.Servers) == 0 {
		if cf.override {
			fmt.Fprintf(cmd.ErrOrStderr(), "warning: --%s without --etcd-servers: nothing was checked\n", guard.OverrideFlag)
			return nil
		}
		return fmt.Errorf("--etcd-servers is required: %s checks in etcd that no stored object, retained backup or live apiserver needs version %d (or pass --%s to skip the check)", action, n, guard.OverrideFlag)
	}
	ecfg, err := cf.etcd.ClientConfig(cf.dialTimeout)
	if err != nil {
		return err
	}
	ecfg.MaxCallRecvMsgSize = 64 << 20
	cli, err := clientv3.New(ecfg)
	if err != nil {
		return fmt.Errorf("connecting to etcd %v: %w; check --etcd-servers and the TLS flags", cf.etcd.Servers, err)
	}
	defer func() { _ = cli.Close() }()
	// A read through the client's balancer, as rekey's CLI checks etcd: any member
	// that answers will do.
	hctx, hcancel := context.WithTimeout(ctx, cf.dialTimeout)
	_, err = cli.Get(hctx, "health", clientv3.WithCountOnly())
	hcancel()
	if err != nil {
		return fmt.Errorf("etcd does not answer at any of %s (%v); check --etcd-servers and the TLS flags: nothing was %sd", strings.Join(cf.etcd.Servers, ","), err, action)
	}
	prefix := cf.coordinationPrefix
	if prefix == "" {
		prefix = layer.DefaultCoordinationPrefix(cf.etcdPrefix)
	}
	cctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	err = inuse.Check(cctx, inuse.Options{
		Client: cli, EtcdPrefix: cf.etcdPrefix, CoordinationPrefix: prefix,
		Retention: cf.retention, RetentionSet: cmd.Flags().Changed(guard.BackupRetentionFlag), Now: time.Now(),
	}, action, fmt.Sprintf("version %d", n), keyID)
	if errors.Is(err, guard.ErrRefused) && cf.override {
		fmt.Fprintf(cmd.ErrOrStderr(), "warning: --%s: going ahead although %v\n", guard.OverrideFlag, err)
		return nil
	}
	return err
}
