package config

import (
	"time"

	"k8s.io/apiserver/pkg/apis/apiserver"
)

// DefaultKMSTimeout is the call timeout of a kms provider whose `timeout` is unset.
// Decoding a file (Load, Parse) already sets it, as upstream's defaulting does; this is
// for configurations built in code and for the checks that bound a plugin call without
// a configuration at hand.
const DefaultKMSTimeout = 3 * time.Second

// KMSTimeout is p's call timeout: its `timeout`, or DefaultKMSTimeout when unset.
func KMSTimeout(p *apiserver.KMSConfiguration) time.Duration {
	if p != nil && p.Timeout != nil && p.Timeout.Duration > 0 {
		return p.Timeout.Duration
	}
	return DefaultKMSTimeout
}
