package reload

import (
	"errors"
	"fmt"

	genericapiserver "k8s.io/apiserver/pkg/server"
	k8shealthz "k8s.io/apiserver/pkg/server/healthz"
)

// PostStartHookName is the post-start hook that runs the reload loop; upstream's name.
const PostStartHookName = "start-encryption-provider-config-automatic-reload"

// HealthChecker returns the single kms-providers check. It probes the KMS providers of
// whatever configuration is current; with no KMS provider it passes.
func (a *Agent) HealthChecker() k8shealthz.HealthChecker { return a.health }

// InstallInto makes the agent c's ResourceTransformers, adds the kms-providers check to
// /healthz and /readyz (never /livez: a KMS outage must not get the apiserver
// restarted), and, with automatic reload, registers the post-start hook that runs the
// reload loop until the server stops. Closing the agent after the server has drained
// stays with the caller.
//
// As kube-apiserver does, the check is left out only when reload is off and the
// configuration has no KMS provider.
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
	if a.opts.AutomaticReload || len(a.cur.Load().set.KMSProviders()) > 0 {
		c.AddHealthzChecks(a.health)
		c.AddReadyzChecks(a.health)
	}
	return nil
}
