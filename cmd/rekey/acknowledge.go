package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/storagelayout"
)

// addCoordinationPrefixFlag adds --coordination-prefix; coordinationPrefix gives it its
// default.
func addCoordinationPrefixFlag(fs *pflag.FlagSet, prefix *string) {
	fs.StringVar(prefix, "coordination-prefix", "", "The apiservers' --coordination-prefix. Default: the apiservers' default for --etcd-prefix ("+coordination.DefaultPrefix+" for /registry).")
}

// acknowledgeFlags are rekey migrate's flags that manage acknowledgements of unreadable
// objects instead of migrating.
type acknowledgeFlags struct {
	acknowledge []string
	remove      []string
	list        bool
	reason      string
	by          string
	prefix      string
}

func (a *acknowledgeFlags) addFlags(fs *pflag.FlagSet) {
	fs.StringSliceVar(&a.acknowledge, "acknowledge-unreadable", nil, "Instead of migrating, acknowledge these unreadable objects (<resource>/<namespace>/<name>, or <resource>/<name> when cluster-scoped; comma separated; rekey inventory lists them) so they no longer keep a migration unverified or a key in use. Each must be unreadable with --encryption-provider-config now. Needs --reason.")
	fs.StringVar(&a.reason, "reason", "", "Why the objects of --acknowledge-unreadable may stay unreadable (recorded with them).")
	fs.StringVar(&a.by, "apiserver-id", "", "Who acknowledges, recorded with the acknowledgement. Default: "+migrate.DefaultAcknowledgedBy+".")
	fs.BoolVar(&a.list, "list-acknowledged", false, "Instead of migrating, list the acknowledged unreadable objects.")
	fs.StringSliceVar(&a.remove, "remove-acknowledgement", nil, "Instead of migrating, remove the acknowledgements of these objects (same form as --acknowledge-unreadable): they block again.")
	addCoordinationPrefixFlag(fs, &a.prefix)
}

// active reports whether one of the acknowledgement modes was asked for.
func (a *acknowledgeFlags) active() bool {
	return len(a.acknowledge) > 0 || len(a.remove) > 0 || a.list
}

// run carries out the acknowledgement mode asked for.
func (a *acknowledgeFlags) run(ctx context.Context, w io.Writer, c *common) error {
	modes := 0
	for _, on := range []bool{len(a.acknowledge) > 0, len(a.remove) > 0, a.list} {
		if on {
			modes++
		}
	}
	if modes > 1 {
		return errors.New("--acknowledge-unreadable, --remove-acknowledgement and --list-acknowledged are separate commands: give one")
	}
	if len(a.acknowledge) > 0 && strings.TrimSpace(a.reason) == "" {
		return errors.New("--acknowledge-unreadable needs --reason: say why the objects may stay unreadable")
	}
	prefix := c.coordinationPrefix(a.prefix)
	if err := coordination.ValidatePrefix(prefix, c.etcdPrefix); err != nil {
		return err
	}
	// Only acknowledging reads stored data; listing and removing need etcd alone.
	s, err := c.open(ctx, preamble{config: len(a.acknowledge) > 0})
	if err != nil {
		return err
	}
	defer s.Close()
	switch {
	case a.list:
		// Listing collects the void ones too: the apiservers' inventories do it as well,
		// but a cluster without them would otherwise keep them forever.
		c, err := migrate.Acknowledger{Client: s.etcd, CoordinationPrefix: prefix}.Collect(ctx)
		if err != nil {
			return err
		}
		writeAcknowledgements(w, c.InForce.Sorted())
		writeCollected(w, c)
		return nil
	case len(a.remove) > 0:
		for _, ref := range a.remove {
			res, ns, name, err := parseObjectRef(c, ref)
			if err != nil {
				return err
			}
			removed, err := migrate.Acknowledger{Client: s.etcd, CoordinationPrefix: prefix}.Remove(ctx, res, ns, name)
			if err != nil {
				return err
			}
			if !removed {
				return fmt.Errorf("%s has no acknowledgement (rekey migrate --list-acknowledged lists them)", ref)
			}
			printLine(w, "removed the acknowledgement of %s", ref)
		}
		return nil
	}
	var errs error
	for _, ref := range a.acknowledge {
		res, ns, name, err := parseObjectRef(c, ref)
		if err != nil {
			return err
		}
		acker := migrate.Acknowledger{Client: s.etcd, CoordinationPrefix: prefix, Source: migrate.FromSet(s.cur.set), By: a.by}
		ack, err := acker.Acknowledge(ctx, res, ns, name, a.reason)
		if err != nil {
			// Go on with the others: each is checked and recorded on its own.
			printLine(w, "not acknowledged: %v", err)
			errs = errors.Join(errs, err)
			continue
		}
		printLine(w, "acknowledged %s (%s, stored prefix %s, mod revision %d)", ref, ack.Class, ack.Prefix, ack.ModRevision)
	}
	return errs
}

// parseObjectRef reads <resource>/<namespace>/<name> or <resource>/<name>; the
// resource's etcd key prefix is the one --resources gives it, else the default layout.
func parseObjectRef(c *common, ref string) (migrate.Resource, string, string, error) {
	parts := strings.Split(ref, "/")
	if len(parts) < 2 || len(parts) > 3 || slices.Contains(parts, "") {
		return migrate.Resource{}, "", "", fmt.Errorf("%q: name an object as <resource>/<namespace>/<name>, or <resource>/<name> when cluster-scoped (e.g. secrets/default/db-password)", ref)
	}
	gr := schema.ParseGroupResource(parts[0])
	layout := storagelayout.Kube(c.etcdPrefix)
	res := layout.Locate(gr)
	for _, spec := range c.resources {
		if r, err := migrate.ParseResource(layout, spec); err == nil && r.GroupResource == gr {
			res = r
		}
	}
	if len(parts) == 2 {
		return res, "", parts[1], nil
	}
	return res, parts[1], parts[2], nil
}

// writeAcknowledgements renders acknowledgements: names, prefixes and reasons come from
// etcd, so they go out through row only.
func writeAcknowledgements(w io.Writer, acks []migrate.Acknowledgement) {
	if len(acks) == 0 {
		fmt.Fprintln(w, "no unreadable object is acknowledged")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	row(tw, "RESOURCE", "NAMESPACE", "NAME", "STORED PREFIX", "CLASS", "MOD REVISION", "AT", "BY", "REASON")
	for _, a := range acks {
		row(tw, a.Resource, orDash(a.Namespace), a.Name, a.Prefix, a.Class, fmt.Sprint(a.ModRevision), a.At.UTC().Format("2006-01-02T15:04:05Z"), a.By, a.Reason)
	}
	_ = tw.Flush()
}

// writeCollected says which void acknowledgements listing deleted, and which it could
// not (they cover nothing; a later listing or inventory deletes them).
func writeCollected(w io.Writer, c migrate.CollectedAcknowledgements) {
	for _, a := range c.Deleted {
		printLine(w, "deleted the void acknowledgement of %s/%s: the object was rewritten or deleted after mod revision %d", a.Resource, objectRef(a), a.ModRevision)
	}
	if c.DeleteErr != nil {
		printLine(w, "could not delete every void acknowledgement (they cover nothing; the next listing or inventory retries): %v", c.DeleteErr)
	}
}

// objectRef is <namespace>/<name>, or <name> when cluster-scoped.
func objectRef(a migrate.Acknowledgement) string {
	if a.Namespace == "" {
		return a.Name
	}
	return a.Namespace + "/" + a.Name
}
