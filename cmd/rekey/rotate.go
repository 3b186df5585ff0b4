package main

import (
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	apiserverv1 "k8s.io/apiserver/pkg/apis/apiserver/v1"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/guard"
)

func newRotateCommand() *cobra.Command {
	var c common
	var r rotation
	var output string
	var removeOld string
	var w waitOptions
	cmd := &cobra.Command{
		Use:   "rotate",
		Short: "Put a new write key first in the encryption configuration, or remove the key it replaced",
		Long: `rotate generates a new random 32-byte key and writes it first in every rule whose
write provider is a local key (aesgcm, aescbc, secretbox); the key it replaces stays right
behind it, so every apiserver can still read what it wrote. --provider changes the type:
aesgcm, secretbox, aescbc (deprecated upstream; a warning is printed) or kms, which adds a
KMS v2 provider (--kms-name, --kms-endpoint unix:///…) first. When no rule writes with a
local key or KMS v2, --provider aesgcm (or secretbox, or kms) encrypts the rules that
write identity (first-time encryption). A KMS v2 name may appear once per file, so --provider kms rotates exactly one
rule (--resources picks it). --resources keeps only the rules naming one of the given
resources as written in the file.

The file is replaced atomically (temporary file in the same directory, fsync, rename)
with its mode and owner kept, and only after pkg/config validated the result; comments
are not kept. -o - prints the new configuration instead (GitOps, a configuration held
in a Secret).

Once every apiserver writes with the new key and the migration is verified (rekey
status, rekey migrate), --remove-old NAME removes the read key NAME (step 1 prints it). It takes a
fresh inventory (--etcd-servers) and refuses, naming resource, key and object count,
when any stored object still needs that key.

--wait runs the whole rotation and follows the apiservers (cluster coordination, under
--coordination-prefix): new key first in the file; every apiserver writes with it; the
migration leader verified every stored object; the old key removed behind the same guard;
every apiserver runs the final file. It exits 0 only then, and non-zero after
--wait-timeout, naming the stage and what it waits for. Run again after an
interruption, it finds the rotation in progress from the file and the cluster and
continues it (no second new key). See docs/rotation.md.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if c.configPath == "" {
				return errors.New("--encryption-provider-config is required: rotate edits that file")
			}
			data, _, err := config.ReadFile(c.configPath)
			if err != nil {
				return err
			}
			cur, err := config.Parse(data, c.configPath, config.Options{Reload: true})
			if err != nil {
				return fmt.Errorf("the current configuration is not valid, so rotate leaves it alone: %w", err)
			}
			ext, err := decodeExternal(data)
			if err != nil {
				return err
			}
			r.resources = c.resources
			if w.wait {
				if output != "" || removeOld != "" {
					return errors.New("--wait runs the whole rotation (both edits) on the file; it does not combine with -o or --remove-old")
				}
				r.now, r.random = time.Now(), rand.Reader
				return c.rotateWait(cmd, r, w)
			}
			var next []byte
			var summary string
			if removeOld != "" {
				next, summary, err = c.removeKeys(cmd, cur, ext, []string{removeOld}, r.resources)
				if err != nil {
					return err
				}
			} else {
				r.now, r.random = time.Now(), rand.Reader
				if next, summary, err = c.addKey(cmd, ext, r); err != nil {
					return err
				}
			}
			if output == "-" {
				_, err := cmd.OutOrStdout().Write(next)
				fmt.Fprintln(cmd.ErrOrStderr(), summary)
				return err
			}
			if output != "" {
				return fmt.Errorf("-o %q: only - (print the new configuration) is supported; without -o the file is replaced", output)
			}
			if err := replaceFile(c.configPath, next); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: %s (%s)\n", c.configPath, summary, config.Hash(next))
			return nil
		},
	}
	c.addFlags(cmd.Flags())
	fs := cmd.Flags()
	fs.StringVar(&r.provider, "provider", "", "Type of the new write key: aesgcm, secretbox, aescbc (deprecated) or kms. Default: the type each rule writes with now.")
	fs.StringVar(&r.kmsName, "kms-name", "", "Name of the new KMS v2 provider (--provider kms).")
	fs.StringVar(&r.kmsEndpoint, "kms-endpoint", "", "Socket of the new KMS v2 plugin, unix:///path (--provider kms).")
	fs.DurationVar(&r.kmsTimeout, "kms-timeout", 0, "Timeout of the new KMS v2 provider (--provider kms); default: the apiserver's (3s).")
	fs.StringVarP(&output, "output", "o", "", "- prints the new configuration to stdout and leaves the file alone.")
	w.addFlags(fs)
	fs.StringVar(&removeOld, "remove-old", "", "Remove this read key (a local key name, a KMS provider name, or identity) from every rule that writes with another key (narrowed by --resources), after the guard allows it. Needs --etcd-servers.")
	return cmd
}

// addKey returns the file's next content with a new write key first (step 1), validated
// as the apiserver would, and a summary line; warnings go to stderr.
func (c *common) addKey(cmd *cobra.Command, ext *apiserverv1.EncryptionConfiguration, r rotation) ([]byte, string, error) {
	res, err := rotateAdd(ext, r)
	if err != nil {
		return nil, "", err
	}
	for _, w := range res.warnings {
		fmt.Fprintln(cmd.ErrOrStderr(), w)
	}
	next, err := encodeExternal(res.cfg)
	if err != nil {
		return nil, "", err
	}
	if _, err := config.Parse(next, c.configPath+" (rotated)", config.Options{Reload: true}); err != nil {
		return nil, "", fmt.Errorf("the rotated configuration would not be valid (file left alone): %w", err)
	}
	return next, fmt.Sprintf("new write key %q first in %s; the previous write key stays for reads", res.newKey, ruleNames(res.cfg, res.rules)) +
		fmt.Sprintf(" until `rekey rotate --remove-old NAME` (NAME: %s)", strings.Join(res.oldKeys, ", ")), nil
}

// removeKeys returns the file's next content without the read keys names (step 2), once
// the guard allowed it: a fresh inventory taken with the current configuration cur, and
// guard.CheckChange from cur to the result.
func (c *common) removeKeys(cmd *cobra.Command, cur *config.Config, ext *apiserverv1.EncryptionConfiguration, names, resources []string) ([]byte, string, error) {
	var parts []string
	for _, name := range names {
		dropped, rules, err := rotateDrop(ext, name, resources)
		if err != nil {
			return nil, "", err
		}
		parts = append(parts, fmt.Sprintf("removed the read key %q from %s", name, ruleNames(dropped, rules)))
		ext = dropped
	}
	next, err := encodeExternal(ext)
	if err != nil {
		return nil, "", err
	}
	nextCfg, err := config.Parse(next, c.configPath+" (without the old key)", config.Options{Reload: true})
	if err != nil {
		return nil, "", fmt.Errorf("removing the old key would give an invalid configuration (file left alone): %w", err)
	}
	if err := c.guardRemoval(cmd, cur, nextCfg); err != nil {
		return nil, "", err
	}
	return next, strings.Join(parts, "; "), nil
}

// guardRemoval takes a fresh inventory with cur and refuses next when it would leave a
// stored object unreadable (guard.CheckChange, the reload guard's rule).
func (c *common) guardRemoval(cmd *cobra.Command, cur, next *config.Config) error {
	if len(c.etcdServers) == 0 {
		return errors.New("--remove-old needs --etcd-servers: the guard counts the objects that still use the old key before it goes")
	}
	ctx := cmd.Context()
	cli, err := c.client(ctx)
	if err != nil {
		return err
	}
	defer cli.Close()
	// The transformers of cur itself: the content the caller read and decided on, not
	// the file read a second time.
	l, err := c.build(ctx, cur, false)
	if err != nil {
		return err
	}
	defer l.set.Close()
	inv, _, err := c.inventory(ctx, cli, l, false, cur, next)
	if err != nil {
		return err
	}
	if vs := guard.CheckChange(inv, cur, next); len(vs) > 0 {
		var b strings.Builder
		for _, v := range vs {
			fmt.Fprintf(&b, "\n  - %s", v)
		}
		return fmt.Errorf("the old key still encrypts stored data; run `rekey migrate` (or wait for the cluster's migrator) and try again:%s", b.String())
	}
	return nil
}

// replaceFile writes data over path atomically: a temporary file in the same directory
// (so the rename does not cross file systems) with path's mode and owner, fsynced, renamed
// over path, and the directory fsynced so the rename survives a crash. A symlink is
// followed and its target replaced, so the link stays.
func replaceFile(path string, data []byte) error {
	target, err := filepath.EvalSymlinks(path)
	if err != nil {
		return fmt.Errorf("resolving %q: %w", path, err)
	}
	fi, err := os.Stat(target)
	if err != nil {
		return fmt.Errorf("reading %q's mode: %w", target, err)
	}
	dir := filepath.Dir(target)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(target)+".rekey-*")
	if err != nil {
		return fmt.Errorf("creating a temporary file next to %q (the directory must be writable; or use -o - and install the output yourself): %w", target, err)
	}
	done := false
	defer func() {
		if !done {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	if err := tmp.Chmod(fi.Mode().Perm()); err != nil {
		return fmt.Errorf("setting the mode of %q: %w", tmp.Name(), err)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		if err := tmp.Chown(int(st.Uid), int(st.Gid)); err != nil {
			return fmt.Errorf("keeping %q's owner %d:%d (run rotate as that user or root, or use -o -): %w", target, st.Uid, st.Gid, err)
		}
	}
	if _, err := io.Copy(tmp, strings.NewReader(string(data))); err != nil {
		return fmt.Errorf("writing %q: %w", tmp.Name(), err)
	}
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("syncing %q: %w", tmp.Name(), err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("closing %q: %w", tmp.Name(), err)
	}
	if err := os.Rename(tmp.Name(), target); err != nil {
		return fmt.Errorf("replacing %q: %w", target, err)
	}
	done = true
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		_ = d.Close()
	}
	return nil
}
