package coordination

import (
	"fmt"
	"strings"
)

// ValidatePrefix checks a coordination prefix against the resource prefix
// (--etcd-prefix): it must be an absolute key path, and neither may contain the other,
// so coordination keys are never mistaken for stored objects (or migrated).
func ValidatePrefix(prefix, resourcePrefix string) error {
	if !strings.HasPrefix(prefix, "/") || strings.HasSuffix(prefix, "/") || len(prefix) < 2 {
		return fmt.Errorf("--coordination-prefix %q must start with / and not end with / (e.g. %s)", prefix, DefaultPrefix)
	}
	if overlaps(prefix, resourcePrefix) {
		// Suggest a prefix that works with this --etcd-prefix: the default itself can be
		// the one that collides (--etcd-prefix /rekey).
		suggest := DefaultPrefix
		if overlaps(suggest, resourcePrefix) {
			suggest = DefaultPrefix + "-coordination"
		}
		return fmt.Errorf("--coordination-prefix %q overlaps --etcd-prefix %q: choose one outside the resource prefix (e.g. %s)", prefix, resourcePrefix, suggest)
	}
	return nil
}

// overlaps reports whether one key prefix contains the other.
func overlaps(prefix, resourcePrefix string) bool {
	p, r := prefix+"/", strings.TrimSuffix(resourcePrefix, "/")+"/"
	return strings.HasPrefix(p, r) || strings.HasPrefix(r, p)
}

// ValidateID checks an apiserver id (--apiserver-id): it is the last element of its
// member key (Member), so it cannot contain a / (it would nest under another member's).
func ValidateID(id string) error {
	if id == "" || strings.ContainsAny(id, "/\x00") || len(id) > 253 {
		return fmt.Errorf("--apiserver-id %q must be 1 to 253 characters without / (e.g. host:port)", id)
	}
	return nil
}
