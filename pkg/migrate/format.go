package migrate

// How inventories and their buckets read in errors and messages.

import (
	"fmt"
	"strings"

	"github.com/rekey-io/rekey/pkg/transformers"
)

func unreadableSample(inv *Inventory) string {
	var parts []string
	for _, r := range inv.Resources {
		if r.Blocking() > 0 {
			parts = append(parts, fmt.Sprintf("%s: %d, e.g. %s", r.Resource, r.Blocking(), strings.Join(unacknowledgedKeys(r), ", ")))
		}
	}
	return strings.Join(parts, "; ")
}

// unacknowledgedKeys names up to maxUnreadableSamples unreadable objects of r that are
// not acknowledged.
func unacknowledgedKeys(r ResourceInventory) []string {
	if r.Acknowledged == 0 {
		return r.UnreadableKeys
	}
	var keys []string
	for _, o := range r.UnreadableObjects {
		if !o.Acknowledged && len(keys) < maxUnreadableSamples {
			keys = append(keys, o.Key)
		}
	}
	return keys
}

// acknowledgedNote says how many unreadable objects were acknowledged, if any.
func acknowledgedNote(n int64) string {
	if n == 0 {
		return ""
	}
	return fmt.Sprintf(" (%d more are acknowledged and do not count)", n)
}

func staleSample(inv *Inventory) string {
	var parts []string
	for _, r := range inv.Resources {
		for _, b := range r.Buckets {
			if b.Stale && b.Objects > 0 {
				parts = append(parts, fmt.Sprintf("%s: %d under %s", r.Resource, b.Objects, b.Describe()))
			}
		}
	}
	return strings.Join(parts, "; ")
}

// Describe names the bucket for an operator: the provider and the key name or KMS key
// id hash, never key material. pkg/guard's refusals name buckets with it too.
func (b Bucket) Describe() string {
	if b.Other {
		return fmt.Sprintf("%s values under further keys or key ids (an inventory lists at most %d distinct buckets per resource)", b.Provider, maxBucketsPerResource)
	}
	switch b.Provider {
	case transformers.ProviderIdentity:
		return "plaintext (identity)"
	case transformers.ProviderKMSv2:
		if b.KeyIDHash != "" {
			return fmt.Sprintf("kms provider %q key id %s", b.Key, b.KeyIDHash)
		}
		return fmt.Sprintf("kms provider %q (undecodable EncryptedObject)", b.Key)
	case transformers.ProviderKMSv1:
		// KMS v1 values carry no key id: the provider name is all they say.
		return fmt.Sprintf("kms v1 provider %q", b.Key)
	}
	if b.Key == "" {
		return fmt.Sprintf("%s with an unreadable key name (prefix %q)", b.Provider, b.Prefix)
	}
	return fmt.Sprintf("%s key %q", b.Provider, b.Key)
}
