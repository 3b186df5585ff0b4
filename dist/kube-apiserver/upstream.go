/*
Copyright 2014 The Kubernetes Authors.

Licensed under the Apache License, Version 2.0 (the "License");
you may not use this file except in compliance with the License.
You may obtain a copy of the License at

    http://www.apache.org/licenses/LICENSE-2.0

Unless required by applicable law or agreed to in writing, software
distributed under the License is distributed on an "AS IS" BASIS,
WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
See the License for the specific language governing permissions and
limitations under the License.
*/

// This file is the only code copied from upstream. It follows k8s.io/kubernetes v1.37.2:
//   - newAPIServerCommand: cmd/kube-apiserver/app/server.go NewAPIServerCommand
//   - run:                 cmd/kube-apiserver/app/server.go Run
//   - newConfig:           cmd/kube-apiserver/app/config.go NewConfig
// Each departure is marked "rekey:". Everything else (options, BuildGenericConfig,
// CreateKubeAPIServerConfig, CreateAPIExtensionsConfig, CreateAggregatorConfig,
// CreateServerChain) is called from upstream's packages unchanged. When moving to a new
// upstream version, diff these three functions against it.

package main

import (
	"context"
	"fmt"
	"os"

	"github.com/spf13/cobra"

	apiextensionsapiserver "k8s.io/apiextensions-apiserver/pkg/apiserver"
	"k8s.io/apimachinery/pkg/runtime"
	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	genericapiserver "k8s.io/apiserver/pkg/server"
	"k8s.io/apiserver/pkg/server/flagz"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/apiserver/pkg/util/webhook"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	cliflag "k8s.io/component-base/cli/flag"
	"k8s.io/component-base/cli/globalflag"
	basecompatibility "k8s.io/component-base/compatibility"
	"k8s.io/component-base/featuregate"
	"k8s.io/component-base/logs"
	logsapi "k8s.io/component-base/logs/api/v1"
	_ "k8s.io/component-base/metrics/prometheus/workqueue"
	"k8s.io/component-base/term"
	utilversion "k8s.io/component-base/version"
	"k8s.io/component-base/version/verflag"
	"k8s.io/klog/v2"
	aggregatorscheme "k8s.io/kube-aggregator/pkg/apiserver/scheme"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
	"k8s.io/kubernetes/cmd/kube-apiserver/app/options"
	"k8s.io/kubernetes/pkg/api/legacyscheme"
	"k8s.io/kubernetes/pkg/controlplane"
	controlplaneapiserver "k8s.io/kubernetes/pkg/controlplane/apiserver"
	generatedopenapi "k8s.io/kubernetes/pkg/generated/openapi"

	rekeylayer "github.com/rekey-io/rekey/pkg/layer"
)

func init() {
	utilruntime.Must(logsapi.AddFeatureGates(utilfeature.DefaultMutableFeatureGate))
}

// newAPIServerCommand is upstream's NewAPIServerCommand with rekey's flag set added and
// a --version line that says rekey is inside.
func newAPIServerCommand() *cobra.Command {
	s := options.NewServerRunOptions()
	r := newRekeyFlags() // rekey
	ctx := genericapiserver.SetupSignalContext()
	featureGate := s.GenericServerRunOptions.ComponentGlobalsRegistry.FeatureGateFor(basecompatibility.DefaultKubeComponent)

	cmd := &cobra.Command{
		Use: "kube-apiserver",
		// rekey: the last paragraph.
		Long: `The Kubernetes API server validates and configures data
for the api objects which include pods, services, replicationcontrollers, and
others. The API Server services REST operations and provides the frontend to the
cluster's shared state through which all other components interact.

This build stores data encrypted at rest through rekey (github.com/rekey-io/rekey).`,

		// stop printing usage when the command errors
		SilenceUsage: true,
		PersistentPreRunE: func(*cobra.Command, []string) error {
			if err := s.GenericServerRunOptions.ComponentGlobalsRegistry.Set(); err != nil {
				return err
			}
			// silence client-go warnings.
			// kube-apiserver loopback clients should not log self-issued warnings.
			rest.SetDefaultWarningHandler(rest.NoWarnings{})
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			printVersionAndExitIfRequested(cmd) // rekey
			verflag.PrintAndExitIfRequested()
			fs := cmd.Flags()
			// Activate logging as soon as possible, after that
			// show flags with the final logging configuration.
			if err := logsapi.ValidateAndApply(s.Logs, featureGate); err != nil {
				return err
			}
			cliflag.PrintFlags(fs)

			// set default options
			completedOptions, err := s.Complete(ctx)
			if err != nil {
				return err
			}

			// validate options
			errs := completedOptions.Validate()
			errs = append(errs, r.Validate()...) // rekey
			if len(errs) != 0 {
				return utilerrors.NewAggregate(errs)
			}
			// add feature enablement metrics
			featureGate.(featuregate.MutableFeatureGate).AddMetrics()
			// add component version metrics
			s.GenericServerRunOptions.ComponentGlobalsRegistry.AddMetrics()
			return run(ctx, completedOptions, r)
		},
		Args: func(cmd *cobra.Command, args []string) error {
			for _, arg := range args {
				if len(arg) > 0 {
					return fmt.Errorf("%q does not take any arguments, got %q", cmd.CommandPath(), args)
				}
			}
			return nil
		},
	}
	cmd.SetContext(ctx)

	fs := cmd.Flags()
	namedFlagSets := s.Flags()
	r.AddFlags(namedFlagSets.FlagSet("rekey")) // rekey
	s.Flagz = flagz.NamedFlagSetsReader{
		FlagSets: namedFlagSets,
	}
	verflag.AddFlags(namedFlagSets.FlagSet("global"))
	globalflag.AddGlobalFlags(namedFlagSets.FlagSet("global"), cmd.Name(), logs.SkipLoggingConfigurationFlags())
	for _, f := range namedFlagSets.FlagSets {
		fs.AddFlagSet(f)
	}

	cols, _, _ := term.TerminalSize(cmd.OutOrStdout())
	cliflag.SetUsageAndHelpFunc(cmd, namedFlagSets, cols)

	return cmd
}

// run is upstream's Run with rekey's layer passed to newConfig and attached to the chain.
func run(ctx context.Context, opts options.CompletedOptions, r *rekeylayer.Flags) error {
	// To help debugging, immediately log version
	klog.Infof("Version: %+v", utilversion.Get())
	klog.InfoS("Encryption at rest", "layer", r.EncryptionLayer, "rekey", rekeyVersion) // rekey

	klog.InfoS("Golang settings", "GOGC", os.Getenv("GOGC"), "GOMAXPROCS", os.Getenv("GOMAXPROCS"), "GOTRACEBACK", os.Getenv("GOTRACEBACK"))

	if opts.InformerName == nil {
		informerName, err := cache.NewInformerName("kube-apiserver")
		if err != nil {
			return err
		}
		opts.InformerName = informerName
	}

	layer := newLayer(r) // rekey
	config, err := newConfig(opts, layer)
	if err != nil {
		layer.close() // rekey
		return err
	}
	completed, err := config.Complete()
	if err != nil {
		layer.close() // rekey
		return err
	}
	server, err := app.CreateServerChain(completed)
	if err != nil {
		layer.close() // rekey
		return err
	}
	layer.attach(server.GenericAPIServer) // rekey: the status document

	prepared, err := server.PrepareRun()
	if err != nil {
		return err
	}

	return prepared.Run(ctx)
}

// newConfig is upstream's NewConfig with one step added: rekey's layer is installed into
// the generic config after BuildGenericConfig and before that config is copied into the
// kube-apiserver, apiextensions and aggregator configs.
func newConfig(opts options.CompletedOptions, layer *layer) (*app.Config, error) {
	c := &app.Config{
		Options: opts,
	}

	// rekey: upstream's etcd options must not build their own transformers.
	restore := layer.takeEncryptionFlags(opts.Etcd)
	genericConfig, versionedInformers, storageFactory, err := controlplaneapiserver.BuildGenericConfig(
		opts.CompletedOptions,
		[]*runtime.Scheme{legacyscheme.Scheme, apiextensionsapiserver.Scheme, aggregatorscheme.Scheme},
		controlplane.DefaultAPIResourceConfigSource(),
		generatedopenapi.GetOpenAPIDefinitions,
		opts.InformerName,
	)
	restore()
	if err != nil {
		return nil, err
	}
	// rekey: the agent becomes ResourceTransformers and the REST options getter is rebuilt
	// on the same storage factory.
	if err := layer.install(genericConfig, storageFactory, opts.Etcd); err != nil {
		return nil, err
	}

	kubeAPIs, serviceResolver, pluginInitializer, err := app.CreateKubeAPIServerConfig(opts, genericConfig, versionedInformers, storageFactory)
	if err != nil {
		return nil, err
	}
	c.KubeAPIs = kubeAPIs

	apiExtensions, err := controlplaneapiserver.CreateAPIExtensionsConfig(*kubeAPIs.ControlPlane.Generic, kubeAPIs.ControlPlane.VersionedInformers, pluginInitializer, opts.CompletedOptions, opts.MasterCount,
		serviceResolver, webhook.NewDefaultAuthenticationInfoResolverWrapper(kubeAPIs.ControlPlane.ProxyTransport, kubeAPIs.ControlPlane.Generic.EgressSelector, kubeAPIs.ControlPlane.Generic.LoopbackClientConfig, kubeAPIs.ControlPlane.Generic.TracerProvider))
	if err != nil {
		return nil, err
	}
	c.ApiExtensions = apiExtensions

	aggregator, err := controlplaneapiserver.CreateAggregatorConfig(*kubeAPIs.ControlPlane.Generic, opts.CompletedOptions, kubeAPIs.ControlPlane.VersionedInformers, serviceResolver, kubeAPIs.ControlPlane.ProxyTransport, kubeAPIs.ControlPlane.Extra.PeerProxy, pluginInitializer)
	if err != nil {
		return nil, err
	}
	layer.wrapOutermost(&aggregator.GenericConfig.Config) // rekey: one /metrics, clients timed
	// rekey: 503 for refused writes of custom resources, CRDs and APIServices too.
	layer.answerRefusedWrites(&apiExtensions.GenericConfig.RESTOptionsGetter, &apiExtensions.ExtraConfig.CRDRESTOptionsGetter,
		&aggregator.GenericConfig.RESTOptionsGetter)
	c.Aggregator = aggregator

	return c, nil
}
