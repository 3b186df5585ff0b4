package cluster

import "fmt"

// ConditionKMSKeyIDReuse is the cluster status condition raised while a member's KMS v2
// plugin reports a key id that another one superseded (a reuse, refused as a write key
// by pkg/transformers/kmsv2): an alarm that lasts until the plugin moves on.
const ConditionKMSKeyIDReuse = "KMSKeyIDReuse"

// kmsKeyIDReuses lists the refused key id reuses the members publish, one
// "<member>: kms <provider> key id <hash> since <time>" each, in member order.
func kmsKeyIDReuses(members []MemberState) []string {
	var out []string
	for _, m := range members {
		for _, k := range m.KMS {
			if k.ReusedKeyIDHash != "" {
				out = append(out, fmt.Sprintf("%s: kms %s key id %s reused since %s", m.APIServerID, k.Name, k.ReusedKeyIDHash,
					k.ReusedSince.UTC().Format("2006-01-02T15:04:05Z")))
			}
		}
	}
	return out
}
