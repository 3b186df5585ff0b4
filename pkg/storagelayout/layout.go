// Package storagelayout says where an apiserver stores each resource in etcd, and which
// resource a stored key belongs to. It is the one owner of that mapping: the inventory,
// the migration, the guard, `rekey status` and `rotate --wait` all ask it.
//
// kube-apiserver does not store a resource at <prefix>/<group>/<resource>/. Its storage
// factory keeps the built-in groups at <prefix>/<resource>/ (deployments.apps at
// /registry/deployments/), renames a few (nodes at /registry/minions/, services at
// /registry/services/specs/), lets cohabiting resources share one path (events and
// events.events.k8s.io), and only custom resources and the apiextensions and aggregator
// servers' own resources use <group>/<resource>. A guessed path that holds no object
// proves nothing about where the objects are, so every Location says whether its prefix
// is known.
package storagelayout

import (
	"fmt"
	"path"
	"sort"
	"strings"
	"sync"

	"k8s.io/apimachinery/pkg/runtime/schema"
)

// DefaultEtcdPrefix is kube-apiserver's --etcd-prefix default.
const DefaultEtcdPrefix = "/registry"

// Location is where one resource's objects are stored.
type Location struct {
	GroupResource schema.GroupResource
	// KeyPrefix is the etcd key prefix of its objects, e.g. "/registry/deployments/".
	// A value's authenticated data is its full key.
	KeyPrefix string
	// Guessed is true when the prefix is only the custom-resource convention's guess:
	// nothing (kube's table, the storage factory of a running apiserver, a stored
	// CustomResourceDefinition, the operator) said the resource is stored there. No
	// object at a guessed prefix proves nothing.
	Guessed bool
}

// String is the resource as a configuration names it ("secrets", "deployments.apps").
func (l Location) String() string { return l.GroupResource.String() }

// Layout maps resources to etcd key prefixes under one --etcd-prefix, and keys back to
// resources. It is safe for concurrent use: a running apiserver adds resources as it
// builds their storage (custom resources appear at any time).
type Layout struct {
	etcdPrefix string

	mu     sync.RWMutex
	dirs   map[schema.GroupResource]string // resource → directory under etcdPrefix, no slashes at the ends
	owners map[string]schema.GroupResource // directory → the resource that owns it
}

// New returns an empty layout under etcdPrefix: every location is a guess until added.
func New(etcdPrefix string) *Layout {
	return &Layout{etcdPrefix: cleanPrefix(etcdPrefix), dirs: map[schema.GroupResource]string{}, owners: map[string]schema.GroupResource{}}
}

// Kube returns kube-apiserver's layout of its built-in resources under etcdPrefix
// (KubeBuiltins); custom resources are added from their stored definitions
// (AddStoredCRDs) or as the apiserver serves them.
func Kube(etcdPrefix string) *Layout {
	l := New(etcdPrefix)
	for _, b := range KubeBuiltins() {
		l.add(b.GroupResource, b.Dir)
	}
	return l
}

// EtcdPrefix is the --etcd-prefix, cleaned ("/registry").
func (l *Layout) EtcdPrefix() string { return l.etcdPrefix }

func cleanPrefix(p string) string {
	p = path.Clean("/" + p)
	if p == "/" {
		return ""
	}
	return p
}

// Add records that gr is stored at dir (relative to the etcd prefix, e.g.
// "deployments" or "example.com/widgets"). A directory already owned by another
// resource stays with its first owner: cohabiting resources share their storage.
func (l *Layout) Add(gr schema.GroupResource, dir string) error {
	dir = strings.Trim(dir, "/")
	if dir == "" || strings.Contains(dir, "//") {
		return fmt.Errorf("storage layout: %s: directory %q is not a path under the etcd prefix", gr, dir)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.add(gr, dir)
	return nil
}

// AddKeyPrefix is Add for a full etcd key prefix (what a storage factory or a
// RESTOptions reports: etcd prefix + "/" + resource prefix).
func (l *Layout) AddKeyPrefix(gr schema.GroupResource, keyPrefix string) error {
	rel, ok := l.relative(keyPrefix)
	if !ok {
		return fmt.Errorf("storage layout: %s is stored at %q, outside the etcd prefix %q", gr, keyPrefix, l.etcdPrefix)
	}
	return l.Add(gr, rel)
}

func (l *Layout) add(gr schema.GroupResource, dir string) {
	l.dirs[gr] = dir
	if _, taken := l.owners[dir]; !taken {
		l.owners[dir] = gr
	}
}

func (l *Layout) relative(key string) (string, bool) {
	if !strings.HasPrefix(key, l.etcdPrefix+"/") {
		return "", false
	}
	return strings.Trim(strings.TrimPrefix(key, l.etcdPrefix+"/"), "/"), true
}

// Locate returns where gr is stored. A resource the layout does not know gets the
// custom-resource convention (<prefix>/<group>/<resource>/, core: <prefix>/<resource>/)
// with Guessed set.
func (l *Layout) Locate(gr schema.GroupResource) Location {
	l.mu.RLock()
	dir, ok := l.dirs[gr]
	l.mu.RUnlock()
	if ok {
		return Location{GroupResource: gr, KeyPrefix: l.etcdPrefix + "/" + dir + "/"}
	}
	return Location{GroupResource: gr, KeyPrefix: l.etcdPrefix + "/" + conventionDir(gr) + "/", Guessed: true}
}

func conventionDir(gr schema.GroupResource) string {
	if gr.Group == "" {
		return gr.Resource
	}
	return gr.Group + "/" + gr.Resource
}

// Owner returns the resource that stores key, and where: the longest known directory
// that holds key, else a guess from the key's shape (a first segment with a dot is a
// group, as custom resources are stored). ok is false for a key outside the etcd
// prefix and for the few keys kube-apiserver writes without the resource transformers
// (Untransformed).
func (l *Layout) Owner(key string) (loc Location, ok bool) {
	rel, in := l.relative(key)
	if !in || rel == "" || Untransformed(rel) {
		return Location{}, false
	}
	segs := strings.Split(rel, "/")
	if len(segs) < 2 {
		return Location{}, false // a key right under the prefix is no resource's object
	}
	l.mu.RLock()
	for n := len(segs) - 1; n >= 1; n-- {
		dir := strings.Join(segs[:n], "/")
		if gr, ok := l.owners[dir]; ok {
			l.mu.RUnlock()
			return Location{GroupResource: gr, KeyPrefix: l.etcdPrefix + "/" + dir + "/"}, true
		}
	}
	l.mu.RUnlock()
	gr := schema.GroupResource{Resource: segs[0]}
	dir := segs[0]
	if strings.Contains(segs[0], ".") && len(segs) > 2 {
		gr = schema.GroupResource{Group: segs[0], Resource: segs[1]}
		dir = segs[0] + "/" + segs[1]
	}
	return Location{GroupResource: gr, KeyPrefix: l.etcdPrefix + "/" + dir + "/", Guessed: true}, true
}

// Known lists every resource the layout knows, sorted by key prefix.
func (l *Layout) Known() []Location {
	l.mu.RLock()
	out := make([]Location, 0, len(l.dirs))
	for gr, dir := range l.dirs {
		out = append(out, Location{GroupResource: gr, KeyPrefix: l.etcdPrefix + "/" + dir + "/"})
	}
	l.mu.RUnlock()
	sort.Slice(out, func(i, j int) bool {
		if out[i].KeyPrefix != out[j].KeyPrefix {
			return out[i].KeyPrefix < out[j].KeyPrefix
		}
		return out[i].GroupResource.String() < out[j].GroupResource.String()
	})
	return out
}

// Some directories are written by kube-apiserver through storage built without the
// resource transformers (the service IP and node port allocators, the apiserver
// endpoint leases): they are plaintext whatever the configuration says, and an
// apiserver refuses to read them encrypted. No inventory or migration touches them.
//
// Untransformed reports whether the key (relative to the etcd prefix) is in one of them.
func Untransformed(rel string) bool {
	first, _, _ := strings.Cut(strings.Trim(rel, "/"), "/")
	switch first {
	case "ranges", "masterleases", "peerserverleases":
		return true
	}
	return false
}
