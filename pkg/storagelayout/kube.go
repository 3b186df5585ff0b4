package storagelayout

import "k8s.io/apimachinery/pkg/runtime/schema"

// Builtin is one resource kube-apiserver stores itself, and its directory under the
// etcd prefix.
type Builtin struct {
	GroupResource schema.GroupResource
	Dir           string
}

// KubeBuiltins is kube-apiserver v1.37's layout of the resources it stores: its storage
// factory's resource prefixes (the resource name, or the few special prefixes compiled
// into Kubernetes), with cohabiting resources of older groups (deployments.extensions)
// at the path of the group that replaced them, and the apiextensions and aggregator
// servers' own resources at <group>/<resource>. A test in dist/kube-apiserver checks it
// against the real storage factory and upstream's own table of expected etcd paths, so
// a Kubernetes upgrade that moves or adds a resource fails there first. Order: by
// resource, with the older groups' cohabitants last, so a shared directory's owner is
// the resource kube-apiserver stores it as (events, not events.events.k8s.io).
func KubeBuiltins() []Builtin {
	return []Builtin{
		{schema.GroupResource{Group: "apiregistration.k8s.io", Resource: "apiservices"}, "apiregistration.k8s.io/apiservices"},
		{schema.GroupResource{Group: "certificates.k8s.io", Resource: "certificatesigningrequests"}, "certificatesigningrequests"},
		{schema.GroupResource{Group: "rbac.authorization.k8s.io", Resource: "clusterrolebindings"}, "clusterrolebindings"},
		{schema.GroupResource{Group: "rbac.authorization.k8s.io", Resource: "clusterroles"}, "clusterroles"},
		{schema.GroupResource{Group: "certificates.k8s.io", Resource: "clustertrustbundles"}, "clustertrustbundles"},
		{schema.GroupResource{Group: "scheduling.k8s.io", Resource: "compositepodgroups"}, "compositepodgroups"},
		{schema.GroupResource{Group: "", Resource: "configmaps"}, "configmaps"},
		{schema.GroupResource{Group: "apps", Resource: "controllerrevisions"}, "controllerrevisions"},
		{schema.GroupResource{Group: "batch", Resource: "cronjobs"}, "cronjobs"},
		{schema.GroupResource{Group: "storage.k8s.io", Resource: "csidrivers"}, "csidrivers"},
		{schema.GroupResource{Group: "storage.k8s.io", Resource: "csinodes"}, "csinodes"},
		{schema.GroupResource{Group: "storage.k8s.io", Resource: "csistoragecapacities"}, "csistoragecapacities"},
		{schema.GroupResource{Group: "apiextensions.k8s.io", Resource: "customresourcedefinitions"}, "apiextensions.k8s.io/customresourcedefinitions"},
		{schema.GroupResource{Group: "apps", Resource: "daemonsets"}, "daemonsets"},
		{schema.GroupResource{Group: "apps", Resource: "deployments"}, "deployments"},
		{schema.GroupResource{Group: "resource.k8s.io", Resource: "deviceclasses"}, "deviceclasses"},
		{schema.GroupResource{Group: "resource.k8s.io", Resource: "devicetaintrules"}, "devicetaintrules"},
		{schema.GroupResource{Group: "", Resource: "endpoints"}, "services/endpoints"},
		{schema.GroupResource{Group: "discovery.k8s.io", Resource: "endpointslices"}, "endpointslices"},
		{schema.GroupResource{Group: "", Resource: "events"}, "events"},
		{schema.GroupResource{Group: "events.k8s.io", Resource: "events"}, "events"},
		{schema.GroupResource{Group: "lifecycle.k8s.io", Resource: "evictionrequests"}, "evictionrequests"},
		{schema.GroupResource{Group: "lifecycle.k8s.io", Resource: "evictions"}, "evictions"},
		{schema.GroupResource{Group: "flowcontrol.apiserver.k8s.io", Resource: "flowschemas"}, "flowschemas"},
		{schema.GroupResource{Group: "autoscaling", Resource: "horizontalpodautoscalers"}, "horizontalpodautoscalers"},
		{schema.GroupResource{Group: "networking.k8s.io", Resource: "ingressclasses"}, "ingressclasses"},
		{schema.GroupResource{Group: "networking.k8s.io", Resource: "ingresses"}, "ingress"},
		{schema.GroupResource{Group: "networking.k8s.io", Resource: "ipaddresses"}, "ipaddresses"},
		{schema.GroupResource{Group: "batch", Resource: "jobs"}, "jobs"},
		{schema.GroupResource{Group: "coordination.k8s.io", Resource: "leasecandidates"}, "leasecandidates"},
		{schema.GroupResource{Group: "coordination.k8s.io", Resource: "leases"}, "leases"},
		{schema.GroupResource{Group: "", Resource: "limitranges"}, "limitranges"},
		{schema.GroupResource{Group: "admissionregistration.k8s.io", Resource: "mutatingadmissionpolicies"}, "mutatingadmissionpolicies"},
		{schema.GroupResource{Group: "admissionregistration.k8s.io", Resource: "mutatingadmissionpolicybindings"}, "mutatingadmissionpolicybindings"},
		{schema.GroupResource{Group: "admissionregistration.k8s.io", Resource: "mutatingwebhookconfigurations"}, "mutatingwebhookconfigurations"},
		{schema.GroupResource{Group: "", Resource: "namespaces"}, "namespaces"},
		{schema.GroupResource{Group: "networking.k8s.io", Resource: "networkpolicies"}, "networkpolicies"},
		{schema.GroupResource{Group: "", Resource: "nodes"}, "minions"},
		{schema.GroupResource{Group: "", Resource: "persistentvolumeclaims"}, "persistentvolumeclaims"},
		{schema.GroupResource{Group: "", Resource: "persistentvolumes"}, "persistentvolumes"},
		{schema.GroupResource{Group: "certificates.k8s.io", Resource: "podcertificaterequests"}, "podcertificaterequests"},
		{schema.GroupResource{Group: "policy", Resource: "poddisruptionbudgets"}, "poddisruptionbudgets"},
		{schema.GroupResource{Group: "scheduling.k8s.io", Resource: "podgroups"}, "podgroups"},
		{schema.GroupResource{Group: "", Resource: "pods"}, "pods"},
		{schema.GroupResource{Group: "", Resource: "podtemplates"}, "podtemplates"},
		{schema.GroupResource{Group: "scheduling.k8s.io", Resource: "priorityclasses"}, "priorityclasses"},
		{schema.GroupResource{Group: "flowcontrol.apiserver.k8s.io", Resource: "prioritylevelconfigurations"}, "prioritylevelconfigurations"},
		{schema.GroupResource{Group: "apps", Resource: "replicasets"}, "replicasets"},
		{schema.GroupResource{Group: "", Resource: "replicationcontrollers"}, "controllers"},
		{schema.GroupResource{Group: "resource.k8s.io", Resource: "resourceclaims"}, "resourceclaims"},
		{schema.GroupResource{Group: "resource.k8s.io", Resource: "resourceclaimtemplates"}, "resourceclaimtemplates"},
		{schema.GroupResource{Group: "resource.k8s.io", Resource: "resourcepoolstatusrequests"}, "resourcepoolstatusrequests"},
		{schema.GroupResource{Group: "", Resource: "resourcequotas"}, "resourcequotas"},
		{schema.GroupResource{Group: "resource.k8s.io", Resource: "resourceslices"}, "resourceslices"},
		{schema.GroupResource{Group: "rbac.authorization.k8s.io", Resource: "rolebindings"}, "rolebindings"},
		{schema.GroupResource{Group: "rbac.authorization.k8s.io", Resource: "roles"}, "roles"},
		{schema.GroupResource{Group: "node.k8s.io", Resource: "runtimeclasses"}, "runtimeclasses"},
		{schema.GroupResource{Group: "", Resource: "secrets"}, "secrets"},
		{schema.GroupResource{Group: "", Resource: "serviceaccounts"}, "serviceaccounts"},
		{schema.GroupResource{Group: "networking.k8s.io", Resource: "servicecidrs"}, "servicecidrs"},
		{schema.GroupResource{Group: "", Resource: "services"}, "services/specs"},
		{schema.GroupResource{Group: "apps", Resource: "statefulsets"}, "statefulsets"},
		{schema.GroupResource{Group: "storage.k8s.io", Resource: "storageclasses"}, "storageclasses"},
		{schema.GroupResource{Group: "storagemigration.k8s.io", Resource: "storageversionmigrations"}, "storageversionmigrations"},
		{schema.GroupResource{Group: "internal.apiserver.k8s.io", Resource: "storageversions"}, "storageversions"},
		{schema.GroupResource{Group: "admissionregistration.k8s.io", Resource: "validatingadmissionpolicies"}, "validatingadmissionpolicies"},
		{schema.GroupResource{Group: "admissionregistration.k8s.io", Resource: "validatingadmissionpolicybindings"}, "validatingadmissionpolicybindings"},
		{schema.GroupResource{Group: "admissionregistration.k8s.io", Resource: "validatingwebhookconfigurations"}, "validatingwebhookconfigurations"},
		{schema.GroupResource{Group: "storage.k8s.io", Resource: "volumeattachments"}, "volumeattachments"},
		{schema.GroupResource{Group: "storage.k8s.io", Resource: "volumeattributesclasses"}, "volumeattributesclasses"},
		{schema.GroupResource{Group: "scheduling.k8s.io", Resource: "workloads"}, "workloads"},
		{schema.GroupResource{Group: "extensions", Resource: "deployments"}, "deployments"},
		{schema.GroupResource{Group: "extensions", Resource: "daemonsets"}, "daemonsets"},
		{schema.GroupResource{Group: "extensions", Resource: "replicasets"}, "replicasets"},
		{schema.GroupResource{Group: "extensions", Resource: "networkpolicies"}, "networkpolicies"},
		{schema.GroupResource{Group: "extensions", Resource: "ingresses"}, "ingress"},
	}
}
