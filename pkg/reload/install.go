package reload

import (
	"errors"
	"fmt"

	genericapiserver "k8s.io/apiserver/pkg/server"
	k8shealthz "k8s.io/apiserver/pkg/server/healthz"

	"github.com/rekey-io/rekey/pkg/healthz"
)

// PostStartHookName is the post-start hook that runs the reload loop; upstream's name.
const PostStartHookName = "start-encryption-provider-config-automatic-reload"

// HealthChecker returns the single kms-providers check. It probes the KMS providers of
// whatever configuration is current; with no KMS provider it passes. InstallInto serves
// it only with automatic reload on.
func (a *Agent) HealthChecker() k8shealthz.HealthChecker { return a.health }

// InstallInto makes the agent c's ResourceTransformers, adds the KMS checks to /healthz
// and /readyz (never /livez: a KMS outage must not get the apiserver restarted), and,
// with automatic reload, registers the post-start hook that runs the reload loop until
// the server stops. Closing the agent after the server has drained stays with the caller.
//
// The checks are named as kube-apiserver names them: with automatic reload, the single
// kms-providers check (present even without KMS providers); without it, one
// kms-provider-<i> check per KMS provider of the file (none without KMS).
func (a *Agent) InstallInto(c *genericapiserver.Config) error {
	if c == nil {
		return errors.New("reload: no server config to install into")
	}
	if c.ResourceTransformers != nil {
		return errors.New("reload: the server config already has resource transformers")
	}
	if a.opts.AutomaticReload {
		err := c.AddPostStartHook(PostStartHookName, func(hc genericapiserver.PostStartHookContext) error {
			go a.Run(hc.Context)
			return nil
		})
		if err != nil {
			return fmt.Errorf("reload: adding post-start hook: %w", err)
		}
	}
	c.ResourceTransformers = a
	if a.opts.AutomaticReload {
		c.AddHealthzChecks(a.health)
		c.AddReadyzChecks(a.health)
		return nil
	}
	// Without reload the providers never change, and upstream serves one check per KMS
	// provider, kms-provider-<i>; probes that name them keep working.
	for i, k := range a.cur.Load().set.KMSProviders() {
		check := healthz.NewProvider(i, k, healthz.Options{Clock: a.clock})
		c.AddHealthzChecks(check)
		c.AddReadyzChecks(check)
	}
	return nil
}
