package main

import (
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/rekey-io/rekey/internal/kmscheck"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers/kmsdial"
)

// Exit codes of rekey kms-check: a failed check is the usual error (1); a command line
// that cannot run exits 2, so that scripts tell "the plugin is broken" from "kms-check
// was called wrong".
const exitUsage = 2

// pluginStartTimeout bounds how long a --plugin-command has to listen on its socket,
// at the start and after each restart.
const pluginStartTimeout = 30 * time.Second

// errChecksFailed makes rekey kms-check exit 1 after printing its report.
var errChecksFailed = errors.New("the KMS v2 plugin failed kms-check")

type kmsCheckFlags struct {
	endpoint      string
	pluginCommand string
	calls         int
	observe       time.Duration
	timeout       time.Duration
	oneVersion    bool
	output        outputFormat
}

func newKMSCheckCommand() *cobra.Command { return newKMSCheckCommandExiting(os.Exit) }

// newKMSCheckCommandExiting is kms-check with the function that ends the process on a
// usage error; tests pass one that records the code.
func newKMSCheckCommandExiting(exit func(int)) *cobra.Command {
	var f kmsCheckFlags
	usage := func(cmd *cobra.Command, err error) error {
		fmt.Fprintf(cmd.ErrOrStderr(), "Error: %v\nSee rekey kms-check --help.\n", err)
		exit(exitUsage)
		return err
	}
	cmd := &cobra.Command{
		Use:   "kms-check",
		Short: "Check a KMS v2 plugin against what kube-apiserver relies on, before trusting it with data",
		Long: `kms-check talks to a KMS v2 plugin over its socket, as an apiserver does, and reports each
check with a verdict: pass; fail (an apiserver with this plugin loses data or cannot
work); warn (it copes, but you should know); not-checked (it could not run here, and says
why). Checks: Status is healthy with a key id; Status and Encrypt agree on the key id;
the key id stays put over --observe; Encrypt/Decrypt round trips; key ids seen earlier
still decrypt after the key id changed (a plugin that keeps one key version per process
is a warning with --one-version-per-process); no key id comes back after another one
(A → B → A; with other key material it fails); annotations and key ids within
kube-apiserver's limits; a call with a short deadline returns in time; p50/p99 latency
of Encrypt and Decrypt over --calls calls.

With --plugin-command, kms-check starts the plugin itself (sh -c, in its own process
group, stopped when kms-check ends) and restarts it once, to check that the key id
survives a restart and that the first Status after a start reports the same key id as
the later ones. Without it those checks are not-checked.

A plugin that reports a fixed key id (a key ARN) passes the key id checks while its
key rotates unseen: rotate with rekey rotate --provider kms instead.

Key ids are printed only as sha256 hashes. Exit code: 0 when no check failed, 1 when
one failed, 2 when the command line is wrong.`,
		Example: `  rekey kms-check --endpoint unix:///var/run/kms/plugin.sock
  rekey kms-check --plugin-command 'kms-plugin --keys-file keys.yaml --listen-addr unix:///tmp/kc/p.sock' -o json`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) > 0 {
				return usage(cmd, fmt.Errorf("kms-check takes no arguments, got %q; give the plugin with --endpoint", args[0]))
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := f.validate(); err != nil {
				return usage(cmd, err)
			}
			return f.run(cmd)
		},
	}
	cmd.SetFlagErrorFunc(usage)
	fs := cmd.Flags()
	fs.StringVar(&f.endpoint, "endpoint", "", "The plugin's socket, unix:///path.sock (or unix:///@abstract). Required unless --plugin-command has --listen-addr.")
	fs.StringVar(&f.pluginCommand, "plugin-command", "", "Shell command that starts the plugin; kms-check runs it, restarts it once for the restart checks, and stops it on exit.")
	fs.IntVar(&f.calls, "calls", kmscheck.DefaultCalls, "Encrypt and Decrypt calls measured for latency and key id agreement.")
	fs.DurationVar(&f.observe, "observe", kmscheck.DefaultObserve, "How long the key id is watched for changes, reuse and old key ids; rotate the plugin's key meanwhile to check that old key ids still decrypt.")
	fs.DurationVar(&f.timeout, "timeout", config.DefaultKMSTimeout, "Timeout of each call, as the provider's `timeout` in the encryption configuration.")
	fs.BoolVar(&f.oneVersion, "one-version-per-process", false, "The plugin decrypts only with its current key version (as Azure's does): old key ids that no longer decrypt are a warning, not a failure.")
	addOutputFlag(fs, &f.output)
	return cmd
}

func (f *kmsCheckFlags) validate() error {
	if f.endpoint == "" && f.pluginCommand != "" {
		f.endpoint = kmscheck.EndpointFromCommand(f.pluginCommand)
	}
	if f.endpoint == "" {
		if f.pluginCommand != "" {
			return errors.New("--plugin-command has no --listen-addr; say where it listens with --endpoint unix:///path.sock")
		}
		return errors.New("--endpoint is required: the plugin's socket, unix:///path.sock (or --plugin-command to start the plugin)")
	}
	if _, err := kmsdial.ParseEndpoint(f.endpoint); err != nil {
		return fmt.Errorf("--endpoint: %w", err)
	}
	if f.calls < 1 {
		return fmt.Errorf("--calls %d: want at least 1", f.calls)
	}
	if f.observe <= 0 {
		return fmt.Errorf("--observe %s: want a positive duration (10s)", f.observe)
	}
	if f.timeout <= 0 {
		return fmt.Errorf("--timeout %s: want a positive duration (3s)", f.timeout)
	}
	return nil
}

func (f *kmsCheckFlags) run(cmd *cobra.Command) error {
	// The plugin child must be stopped however kms-check ends, Ctrl-C included.
	ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	o := kmscheck.Options{Endpoint: f.endpoint, Calls: f.calls, Observe: f.observe, Timeout: f.timeout, OneVersionPerProcess: f.oneVersion}
	if f.pluginCommand != "" {
		p, err := kmscheck.StartPlugin(ctx, f.pluginCommand, f.endpoint, pluginStartTimeout, cmd.ErrOrStderr())
		if err != nil {
			return err
		}
		defer p.Stop()
		o.Restart = p.Restart
	}
	r, err := kmscheck.Run(ctx, o)
	if err != nil {
		return err
	}
	if err := f.output.write(cmd.OutOrStdout(), r, func(w io.Writer) { writeKMSCheckTable(w, r) }); err != nil {
		return err
	}
	if r.Failed() {
		var failed []string
		for _, c := range r.Checks {
			if c.Verdict == kmscheck.Fail {
				failed = append(failed, c.Name)
			}
		}
		return fmt.Errorf("%w: %s; see each check's detail, and do not configure this plugin before they pass", errChecksFailed, strings.Join(failed, ", "))
	}
	return nil
}

// writeKMSCheckTable renders the report, the detail last (it is long, and a column
// after it would be padded to its width); details quote what the plugin answered, so
// they go out through row only.
func writeKMSCheckTable(w io.Writer, r *kmscheck.Report) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	row(tw, "CHECK", "VERDICT", "FIGURES", "DETAIL")
	counts := map[kmscheck.Verdict]int{}
	for _, c := range r.Checks {
		counts[c.Verdict]++
		row(tw, c.Name, string(c.Verdict), figuresText(c.Figures), c.Detail)
	}
	_ = tw.Flush()
	fmt.Fprintf(w, "%d passed, %d warned, %d failed, %d not checked\n", counts[kmscheck.Pass], counts[kmscheck.Warn], counts[kmscheck.Fail], counts[kmscheck.NotChecked])
}

// figuresText is name=value pairs sorted by name, "-" when there are none.
func figuresText(figs map[string]float64) string {
	if len(figs) == 0 {
		return "-"
	}
	names := make([]string, 0, len(figs))
	for n := range figs {
		names = append(names, n)
	}
	sort.Strings(names)
	parts := make([]string, len(names))
	for i, n := range names {
		parts[i] = n + "=" + figureText(figs[n])
	}
	return strings.Join(parts, " ")
}

// figureText writes counts and byte sizes whole (32768, not 3.277e+04) and
// measurements to four significant digits.
func figureText(v float64) string {
	if v == math.Trunc(v) && math.Abs(v) < 1e15 {
		return strconv.FormatFloat(v, 'f', 0, 64)
	}
	return strconv.FormatFloat(v, 'g', 4, 64)
}
