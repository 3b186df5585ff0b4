package cluster

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"k8s.io/apiserver/pkg/server/healthz"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// ReadyzCheckName is the /readyz check of a Node: /readyz/rekey-cluster.
const ReadyzCheckName = "rekey-cluster"

// ReadyzCheck fails, naming the missing keys, while this apiserver's configuration
// cannot read a key the cluster uses: one another live member writes with, or one the
// latest inventory counts stored objects under and another live member can read. Load balancers then stop sending the
// straggler traffic it would answer with errors. It belongs on /readyz only: a
// straggler is healthy, it just must not serve yet.
func (n *Node) ReadyzCheck() healthz.HealthChecker {
	return healthz.NamedCheck(ReadyzCheckName, func(*http.Request) error {
		n.mu.Lock()
		agent := n.agent
		n.mu.Unlock()
		if agent == nil {
			return fmt.Errorf("the encryption agent has not started")
		}
		// Fail closed until this apiserver knows enough to judge: without the member
		// list nothing says which keys the others write, and without an inventory
		// nothing says which keys the stored objects need (a straggler restarted with
		// an old file would look ready until its first inventory).
		if !n.view.Loaded() {
			return fmt.Errorf("the list of live apiservers under %s has not been loaded yet; check the connection to etcd", MembersPrefix(n.opts.Prefix))
		}
		if err := n.publishFailure(); err != nil {
			return err
		}
		if n.opts.Inventory != nil && n.opts.Inventory.Latest() == nil {
			return fmt.Errorf("no inventory of the stored objects yet, so it is not known whether this apiserver's encryption configuration can read them; waiting for the first one")
		}
		if missing := n.MissingKeys(); len(missing) > 0 {
			return fmt.Errorf("this apiserver's encryption configuration cannot read keys the cluster uses: %s; add them to its configuration (as read keys)", strings.Join(missing, "; "))
		}
		return nil
	})
}

// MissingKeys lists what ReadyzCheck reports.
func (n *Node) MissingKeys() []string {
	own := n.state(time.Time{})
	var missing []string
	add := func(s string) {
		if !slices.Contains(missing, s) {
			missing = append(missing, s)
		}
	}
	var others []MemberState
	for _, m := range n.view.Members() {
		if m.APIServerID == n.opts.ID {
			continue
		}
		others = append(others, m)
		for _, r := range m.Resources {
			if !own.CanRead(r.Resource, r.Write) {
				add(fmt.Sprintf("%s: %s (written by %s)", r.Resource, r.Write, m.APIServerID))
			}
		}
	}
	if n.opts.Inventory != nil {
		if inv := n.opts.Inventory.Latest(); inv != nil {
			for _, ri := range inv.Resources {
				for _, c := range ri.Buckets {
					k := Key{Provider: c.Provider, Key: c.Key}
					if c.Objects == 0 || c.Provider == transformers.ProviderUnknown || own.CanRead(ri.Resource, k) {
						continue
					}
					// Only a key another live member reads is one the cluster uses: data
					// nobody can read is lost, and failing every apiserver's readiness for
					// it would take the whole control plane down.
					if by := readBy(others, ri.Resource, k); by != "" {
						add(fmt.Sprintf("%s: %s (%d stored objects, readable by %s)", ri.Resource, k, c.Objects, by))
					}
				}
			}
		}
	}
	return missing
}

// readBy names the first member that can read k for resource ("" if none).
func readBy(members []MemberState, resource string, k Key) string {
	for _, m := range members {
		if m.CanRead(resource, k) {
			return m.APIServerID
		}
	}
	return ""
}
