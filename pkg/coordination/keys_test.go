package coordination

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

// builders builds one key of each entry of Keys from prefix, with the same sample id
// (and a sample object for acknowledgements): TestBuildersFollowTable holds them to the
// table and TestDefaultPrefixKeys to the keys in etcd today.
func builders(prefix string) map[string]string {
	return map[string]string{
		"identity":             Identity(prefix),
		"members":              Member(prefix, "node-a:6443"),
		"migration leader":     MigrationLeader(prefix),
		"migration checkpoint": MigrationCheckpoint(prefix),
		"migration state":      MigrationState(prefix),
		"migration clients":    MigrationClients(prefix, "node-a:6443"),
		"verified inventory":   MigrationVerified(prefix, "secrets"),
		"key writes":           KeyWrites(prefix, "0123456789abcdef0123456789abcdef"),
		"applied state":        AppliedState(prefix, "node-a:6443"),
		"key ledger":           Ledger(prefix),
		"acknowledgements":     Acknowledgement(prefix, "secrets", "team-a", "lost"),
	}
}

// TestDefaultPrefixKeys pins the keys as they are in etcd: clusters running older
// versions keep these keys, so a change here strands their state.
func TestDefaultPrefixKeys(t *testing.T) {
	want := map[string]string{
		"identity":             "/rekey/cluster",
		"members":              "/rekey/members/node-a:6443",
		"migration leader":     "/rekey/migration/leader",
		"migration checkpoint": "/rekey/migration/checkpoint",
		"migration state":      "/rekey/migration/state",
		"migration clients":    "/rekey/migration/clients/node-a:6443",
		"verified inventory":   "/rekey/migration/verified/secrets",
		"key writes":           "/rekey/keywrites/0123456789abcdef0123456789abcdef",
		"applied state":        "/rekey/applied/node-a:6443",
		"key ledger":           "/rekey/ledger",
		"acknowledgements":     "/rekey/acknowledged/secrets/team-a/lost",
	}
	got := builders(DefaultPrefix)
	for name, key := range want {
		if got[name] != key {
			t.Errorf("%s: key %q, want %q (the key older versions use)", name, got[name], key)
		}
	}
	for _, c := range []struct{ what, got, want string }{
		{"members directory", MembersPrefix(DefaultPrefix), "/rekey/members/"},
		{"key writes directory", KeyWritesPrefix(DefaultPrefix), "/rekey/keywrites/"},
		{"acknowledgements directory", AcknowledgedPrefix(DefaultPrefix), "/rekey/acknowledged/"},
		{"cluster-scoped acknowledgement", Acknowledgement(DefaultPrefix, "namespaces", "", "gone"), "/rekey/acknowledged/namespaces/gone"},
		{"legacy applied state", LegacyAppliedStatePrefix + "node-a:6443", "/rekey/applied/node-a:6443"},
	} {
		if c.got != c.want {
			t.Errorf("%s: key %q, want %q", c.what, c.got, c.want)
		}
	}
}

// TestBuildersFollowTable: every entry of the table has a builder, every builder an
// entry, and each builds its entry's path under the prefix it is given.
func TestBuildersFollowTable(t *testing.T) {
	const prefix = "/some/prefix"
	built := builders(prefix)
	for _, e := range Keys() {
		key, ok := built[e.Name]
		if !ok {
			t.Errorf("entry %q has no builder in builders(): add one, and pin its key in TestDefaultPrefixKeys", e.Name)
			continue
		}
		delete(built, e.Name)
		if !strings.HasPrefix(key, prefix+e.Path) {
			t.Errorf("entry %q: builder makes %q, want a key under %s%s", e.Name, key, prefix, e.Path)
		}
		if e.ID == "" && key != prefix+e.Path {
			t.Errorf("entry %q is a single key %s%s, but its builder makes %q", e.Name, prefix, e.Path, key)
		}
	}
	for name := range built {
		t.Errorf("builders() has %q, which Keys() does not list: add it to the table", name)
	}
}

// overlapping lists the pairs of entries whose keys may collide: the fixed part of one
// (its Path) starts with the other's, so a read or watch of the one's keys can see the
// other's (or a single key equals another's). A pair one of which declares the other in
// Within nests on purpose.
func overlapping(entries []Entry) []string {
	var out []string
	for i, a := range entries {
		for _, b := range entries[i+1:] {
			if !strings.HasPrefix(a.Path, b.Path) && !strings.HasPrefix(b.Path, a.Path) {
				continue
			}
			if a.Within == b.Name || b.Within == a.Name {
				continue
			}
			out = append(out, fmt.Sprintf("%s (%s) and %s (%s)", a.Name, a.Shape(), b.Name, b.Shape()))
		}
	}
	return out
}

func TestNoTwoEntriesOverlap(t *testing.T) {
	for _, o := range overlapping(Keys()) {
		t.Errorf("overlapping coordination keys: %s; give one another path, or set Within if one nests in the other on purpose", o)
	}
}

// TestOverlapCheckCatches: the check above would see a collision, and accepts a nesting
// declared in Within.
func TestOverlapCheckCatches(t *testing.T) {
	members := Entry{Name: "members", Path: "/members/", ID: "<id>"}
	for _, c := range []struct {
		name    string
		entries []Entry
		want    int
	}{
		{"same key", []Entry{{Name: "a", Path: "/ledger"}, {Name: "b", Path: "/ledger"}}, 1},
		{"single key is a prefix of a directory", []Entry{{Name: "a", Path: "/ledger"}, {Name: "b", Path: "/ledgers/", ID: "<id>"}}, 1},
		{"directory holds a key", []Entry{members, {Name: "b", Path: "/members/special"}}, 1},
		{"nested on purpose", []Entry{members, {Name: "b", Path: "/members/special", Within: "members"}}, 0},
		{"Within names another entry", []Entry{members, {Name: "b", Path: "/members/special", Within: "ledger"}}, 1},
		{"apart", []Entry{members, {Name: "b", Path: "/ledger"}}, 0},
		{"siblings", []Entry{{Name: "a", Path: "/migration/leader"}, {Name: "b", Path: "/migration/state"}}, 0},
	} {
		if got := overlapping(c.entries); len(got) != c.want {
			t.Errorf("%s: overlapping = %q, want %d pair(s)", c.name, got, c.want)
		}
	}
}

// TestTableIsWellFormed: names are unique, paths absolute, directories have ids, and
// every column is filled in, so the documented table says something for every key.
func TestTableIsWellFormed(t *testing.T) {
	var names []string
	for _, e := range Keys() {
		if slices.Contains(names, e.Name) {
			t.Errorf("two entries are named %q", e.Name)
		}
		names = append(names, e.Name)
		if !strings.HasPrefix(e.Path, "/") || e.Path == "/" {
			t.Errorf("entry %q: path %q must start with / and name something below the prefix", e.Name, e.Path)
		}
		if strings.HasSuffix(e.Path, "/") && e.ID == "" {
			t.Errorf("entry %q: directory %q needs an ID placeholder for its keys", e.Name, e.Path)
		}
		if e.Owner == "" || e.Holds == "" || e.Lifetime == "" {
			t.Errorf("entry %q: owner, holds and lifetime must all be set: %+v", e.Name, e)
		}
		if strings.Contains(e.Holds, "|") {
			t.Errorf("entry %q: holds must not contain | (it breaks the table in docs/cluster.md)", e.Name)
		}
	}
	for _, e := range Keys() {
		if e.Within != "" && !slices.Contains(names, e.Within) {
			t.Errorf("entry %q: Within %q names no entry", e.Name, e.Within)
		}
	}
}

func TestKeysReturnsACopy(t *testing.T) {
	k := Keys()
	k[0].Path = "/changed"
	if Keys()[0].Path == "/changed" {
		t.Error("Keys() hands out shared state: a caller changed what the next one sees")
	}
}

func TestValidatePrefix(t *testing.T) {
	for _, c := range []struct {
		prefix, resource string
		ok               bool
	}{
		{"/rekey", "/registry", true},
		{"/registry", "/registry", false},
		{"/registry/rekey", "/registry", false},
		{"/reg", "/registry", true},
		{"/", "/registry", false},
		{"rekey", "/registry", false},
		{"/rekey/", "/registry", false},
	} {
		if err := ValidatePrefix(c.prefix, c.resource); (err == nil) != c.ok {
			t.Errorf("ValidatePrefix(%q, %q) = %v, want ok=%v", c.prefix, c.resource, err, c.ok)
		}
	}
	// The suggested prefix must itself be valid with that --etcd-prefix (the bench once
	// used --etcd-prefix /rekey, where the default is the collision).
	for _, resource := range []string{"/registry", "/rekey", "/rekey/data"} {
		err := ValidatePrefix(resource, resource)
		_, suggest, ok := strings.Cut(fmt.Sprint(err), "(e.g. ")
		suggest = strings.TrimSuffix(suggest, ")")
		if !ok || ValidatePrefix(suggest, resource) != nil {
			t.Errorf("ValidatePrefix(%q, %q) = %v; its suggestion %q does not fit that --etcd-prefix", resource, resource, err, suggest)
		}
	}
}

func TestValidateID(t *testing.T) {
	for id, ok := range map[string]bool{
		"node-a:6443":            true,
		"10.0.0.1:6443":          true,
		strings.Repeat("a", 253): true,
		"":                       false,
		"a/b":                    false,
		"a\x00b":                 false,
		strings.Repeat("a", 254): false,
	} {
		err := ValidateID(id)
		if (err == nil) != ok {
			t.Errorf("ValidateID(%q) = %v, want ok=%v", id, err, ok)
		}
		if err != nil && !strings.Contains(err.Error(), "--apiserver-id") {
			t.Errorf("ValidateID(%q) = %v: the error should name the flag", id, err)
		}
	}
}
