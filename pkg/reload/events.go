package reload

import (
	"fmt"
	"slices"

	"github.com/rekey-io/rekey/internal/errtext"
	"github.com/rekey-io/rekey/pkg/events"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// reportApplied sends the events of a swap from the rules before to the rules after:
// the configuration applied, and each read key a rule no longer has (a key dropped:
// objects still under it would be unreadable, which the guards refused to allow
// unless overridden).
func (a *Agent) reportApplied(before, after []transformers.RuleInfo, hash string) {
	a.events.Event(events.Normal, events.ReasonConfigApplied,
		fmt.Sprintf("applied encryption configuration %s: %s", hash, writersText(after)))
	for _, d := range droppedKeys(before, after) {
		a.events.Event(events.Normal, events.ReasonKeyDropped, d)
	}
}

// reportRefenced sends the event of the write fence changing rule r's writer from
// what rule o wrote with.
func (a *Agent) reportRefenced(r, o transformers.RuleInfo) {
	kind, reason := events.Normal, events.ReasonWriteKeyPromoted
	if r.WriteRefused != "" {
		kind, reason = events.Warning, events.ReasonWritesRefused
	}
	a.events.Event(kind, reason, fmt.Sprintf("%s: the write fence changed the write key from %s to %s (configured: %s)",
		r.Resource, writerName(o), writerName(r), r.ReadKeys[0].String()))
}

// refusedMessage is the event text of a refused reload, bounded as the status document's.
func refusedMessage(hash string, err error) string {
	return fmt.Sprintf("refused encryption configuration %s; the previous one keeps serving: %s", hash, errtext.Bounded(err, errtext.MaxPublished))
}

// writersText lists what each rule writes with, for the applied event.
func writersText(rules []transformers.RuleInfo) string {
	s := ""
	for i, r := range rules {
		if i > 0 {
			s += "; "
		}
		s += r.Resource + " writes with " + writerName(r)
	}
	return s
}

// droppedKeys says, for each rule of before, which of its read keys the rule of the
// same resource in after no longer has (a resource whose rule disappears drops all).
func droppedKeys(before, after []transformers.RuleInfo) []string {
	var out []string
	for _, b := range before {
		var keep []transformers.KeyInfo
		for _, r := range after {
			if r.Resource == b.Resource {
				keep = r.ReadKeys
			}
		}
		for _, k := range b.ReadKeys {
			// A KMS key id is the plugin's, not the configuration's: a new one drops nothing.
			if !slices.ContainsFunc(keep, func(c transformers.KeyInfo) bool {
				return c.Provider == k.Provider && c.Key == k.Key && c.Check == k.Check
			}) {
				out = append(out, fmt.Sprintf("%s: key %s is no longer read", b.Resource, transformers.KeyInfo{Provider: k.Provider, Key: k.Key}.String()))
			}
		}
	}
	return out
}
