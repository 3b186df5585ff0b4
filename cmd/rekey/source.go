package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/spf13/pflag"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/rekey-io/rekey/internal/atomicfile"
	"github.com/rekey-io/rekey/internal/configsource"
	"github.com/rekey-io/rekey/internal/rotation"
	"github.com/rekey-io/rekey/pkg/config"
)

// sourceFlags say where the configuration is kept: the file the apiservers read
// (--encryption-provider-config), or a key of a Secret a platform projects into every
// apiserver's pod (--secret, reached with a kubeconfig as kubectl reaches it).
type sourceFlags struct {
	configPath string
	secret     string
	kubeconfig string
	context    string
	// set is a source given in code (rekey controller: the object's Secret), used
	// instead of the flags.
	set configsource.Source
	// built is the source the flags named, built on first use: rotate --wait reads
	// the configuration every --wait-interval, and a Secret's source is a kubeconfig
	// load and a clientset.
	built configsource.Source
}

func (f *sourceFlags) addFlags(fs *pflag.FlagSet) {
	fs.StringVar(&f.configPath, "encryption-provider-config", "", "The EncryptionConfiguration the apiservers run now. Required, unless --secret names where it is kept.")
	fs.StringVar(&f.secret, "secret", "", "NAMESPACE/NAME[:KEY]: the configuration is kept in this key of a Secret (the only key when KEY is left out), read and replaced through the Kubernetes API with resourceVersion compare-and-swap; instead of --encryption-provider-config.")
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "The kubeconfig of the API that holds --secret (default: $KUBECONFIG, ~/.kube/config, or the pod's service account).")
	fs.StringVar(&f.context, "context", "", "The kubeconfig context of --secret's API (default: the current context).")
}

// given reports whether a source was named.
func (f *sourceFlags) given() bool { return f.configPath != "" || f.secret != "" || f.set != nil }

// source is the configuration's source the flags name, built once per command.
func (f *sourceFlags) source() (configsource.Source, error) {
	if f.set != nil {
		return f.set, nil
	}
	if f.built == nil {
		src, err := f.build()
		if err != nil {
			return nil, err
		}
		f.built = src
	}
	return f.built, nil
}

func (f *sourceFlags) build() (configsource.Source, error) {
	switch {
	case f.configPath != "" && f.secret != "":
		return nil, errors.New("--encryption-provider-config and --secret both name the configuration: give one")
	case f.configPath != "":
		return fileSource{path: f.configPath}, nil
	case f.secret == "":
		return nil, errors.New("--encryption-provider-config (a file) or --secret (a Secret's key) is required: the configuration the apiservers run")
	}
	ref, err := configsource.ParseSecretRef(f.secret)
	if err != nil {
		return nil, err
	}
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = f.kubeconfig
	rc, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: f.context}).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("--secret %s: no API to read it from: %w (give --kubeconfig, or run where a kubeconfig or a service account is found)", f.secret, err)
	}
	rc.UserAgent = "rekey"
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("--secret %s: %w", f.secret, err)
	}
	return configsource.Secret{Client: cs.CoreV1(), Ref: ref}, nil
}

// fileSource is the configuration file: its version is its content's hash, and a
// replacement is checked and written under the file's edit lock (lockForEdit), so two
// rotate runs cannot both pass the check and the second rename drop the first edit.
type fileSource struct{ path string }

func (s fileSource) String() string { return s.path }

func (s fileSource) Read(context.Context) ([]byte, string, error) {
	return config.ReadFile(s.path)
}

func (s fileSource) Replace(ctx context.Context, version string, data []byte) error {
	unlock, err := lockForEdit(ctx, s.path)
	if err != nil {
		return err
	}
	defer unlock()
	_, now, err := config.ReadFile(s.path)
	if err != nil {
		return err
	}
	if now != version {
		return fmt.Errorf("%s: %w", s.path, configsource.ErrChanged)
	}
	return atomicfile.WriteFile(s.path, data, 0o600)
}

// sourced is the configuration as read for a decision to edit it, with the version
// the edit must replace.
type sourced struct {
	*rotation.File
	version string
}

// readSource reads the configuration for an edit; invalid says what a configuration
// that is not valid means for the caller.
func (c *common) readSource(ctx context.Context, invalid string) (sourced, error) {
	src, err := c.src.source()
	if err != nil {
		return sourced{}, err
	}
	data, version, err := src.Read(ctx)
	if err != nil {
		return sourced{}, err
	}
	f, err := rotation.ParseFile(data, src.String())
	if err != nil {
		return sourced{}, fmt.Errorf("%s: %w", invalid, err)
	}
	return sourced{File: f, version: version}, nil
}

// replaceSource replaces the configuration with e, provided it is still at the
// version f was read at (configsource.ErrChanged otherwise).
func (c *common) replaceSource(ctx context.Context, f sourced, e *rotation.Edit) error {
	src, err := c.src.source()
	if err != nil {
		return err
	}
	return src.Replace(ctx, f.version, e.Data)
}

// loadSource reads and checks the configuration for a command that reads stored data.
func (c *common) loadSource(ctx context.Context) (*config.Config, error) {
	src, err := c.src.source()
	if err != nil {
		return nil, err
	}
	data, _, err := src.Read(ctx)
	if err != nil {
		return nil, err
	}
	return config.Parse(data, src.String(), config.Options{Reload: true})
}

// sourceName names the configuration's source in messages.
func (c *common) sourceName() string {
	if c.src.set != nil {
		return c.src.set.String()
	}
	if c.src.secret != "" {
		if ref, err := configsource.ParseSecretRef(c.src.secret); err == nil {
			return ref.String()
		}
		return "--secret " + c.src.secret
	}
	return c.src.configPath
}
