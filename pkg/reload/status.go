package reload

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/rekey-io/rekey/pkg/config"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// StatusPath is where the apiserver shim serves StatusHandler.
const StatusPath = "/rekey/status"

// Status describes the active configuration and the reload history for people and
// tools. It holds names, hashes and times, never key material.
type Status struct {
	// ConfigPath is the watched file.
	ConfigPath string `json:"configPath"`
	// AutomaticReload reports whether the file is watched.
	AutomaticReload bool `json:"automaticReload"`
	// ActiveConfigHash is "sha256:<hex>" of the file content in use.
	ActiveConfigHash string `json:"activeConfigHash"`
	// FIPS is whether the agent builds its configurations in FIPS 140-3 mode
	// (transformers.Options.FIPS): a provider outside the approved set is refused.
	FIPS bool `json:"fips"`
	// LoadedAt is when the active configuration was applied.
	LoadedAt time.Time `json:"loadedAt"`
	// ReloadsSucceeded and ReloadsFailed count applied and refused changes since start.
	ReloadsSucceeded int64 `json:"reloadsSucceeded"`
	ReloadsFailed    int64 `json:"reloadsFailed"`
	// LastAttemptAt is when the file was last read for a reload.
	LastAttemptAt time.Time `json:"lastAttemptAt,omitzero"`
	// LastError is the latest refused change (empty if none since start); it stays after
	// later successes, so compare LastErrorAt with LoadedAt.
	LastError   string    `json:"lastError,omitempty"`
	LastErrorAt time.Time `json:"lastErrorAt,omitzero"`
	// LastErrorConfigHash is the content hash that was refused ("" if unreadable).
	LastErrorConfigHash string `json:"lastErrorConfigHash,omitempty"`
	// ReplacedPendingClose counts replaced configurations still in their grace period.
	ReplacedPendingClose int64 `json:"replacedPendingClose"`
	// Resources describes every resource rule in file order: the write provider, its key
	// name (or KMS provider name with its key id hash, write expiry and health).
	Resources []transformers.RuleInfo `json:"resources"`
	// KMSProviders lists every KMS provider of the active configuration in file order.
	KMSProviders []transformers.KMSStatus `json:"kmsProviders"`
	// KeyWrites counts, per key, the values this apiserver sealed since it started,
	// over every configuration it served (transformers.WriteCounts).
	KeyWrites []transformers.KeyWrites `json:"keyWrites"`
	// Extras are the sections Options.StatusExtras added. They are marshalled as
	// top-level members after the ones above (sorted by key); a key that names one of
	// the members above is left out. Unmarshalling leaves Extras empty.
	Extras map[string]any `json:"-"`
}

// statusFields is Status without its MarshalJSON.
type statusFields Status

// MarshalJSON writes the fields of Status, then each of Extras as a member of its own.
// Times are RFC 3339 in UTC and lists are [] when empty (docs/status.md).
func (s Status) MarshalJSON() ([]byte, error) {
	f := statusFields(s)
	f.LoadedAt, f.LastAttemptAt, f.LastErrorAt = utc(f.LoadedAt), utc(f.LastAttemptAt), utc(f.LastErrorAt)
	f.Resources = make([]transformers.RuleInfo, len(s.Resources))
	for i, r := range s.Resources {
		if r.ReadPrefixes == nil {
			r.ReadPrefixes = []string{}
		}
		if r.ReadKeys == nil {
			r.ReadKeys = []transformers.KeyInfo{}
		}
		if r.KMS != nil {
			k := kmsUTC(*r.KMS)
			r.KMS = &k
		}
		f.Resources[i] = r
	}
	if f.KeyWrites == nil {
		f.KeyWrites = []transformers.KeyWrites{}
	}
	f.KMSProviders = make([]transformers.KMSStatus, len(s.KMSProviders))
	for i, k := range s.KMSProviders {
		f.KMSProviders[i] = kmsUTC(k)
	}
	base, err := json.Marshal(f)
	if err != nil {
		return nil, err
	}
	if len(s.Extras) == 0 {
		return base, nil
	}
	var own map[string]json.RawMessage
	if err := json.Unmarshal(base, &own); err != nil {
		return nil, err
	}
	keys := make([]string, 0, len(s.Extras))
	for k := range s.Extras {
		if _, clash := own[k]; !clash {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	var b bytes.Buffer
	b.Write(base[:len(base)-1]) // without the closing brace
	for _, k := range keys {
		v, err := json.Marshal(s.Extras[k])
		if err != nil {
			return nil, fmt.Errorf("status document section %q: %w", k, err)
		}
		name, _ := json.Marshal(k)
		b.WriteByte(',')
		b.Write(name)
		b.WriteByte(':')
		b.Write(v)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

func utc(t time.Time) time.Time {
	if t.IsZero() {
		return t
	}
	return t.UTC()
}

func kmsUTC(k transformers.KMSStatus) transformers.KMSStatus {
	k.WriteExpiry, k.LastStatus = utc(k.WriteExpiry), utc(k.LastStatus)
	return k
}

// Status returns the status document.
func (a *Agent) Status() Status {
	st := a.OwnStatus()
	if a.opts.StatusExtras != nil {
		st.Extras = a.opts.StatusExtras()
	}
	return st
}

// OwnStatus is the status document without the sections of Options.StatusExtras: what
// those sections' providers may read without recursing into themselves.
func (a *Agent) OwnStatus() Status {
	a.stateMu.Lock()
	g := a.cur.Load()
	s := a.state
	a.stateMu.Unlock()
	st := Status{
		ConfigPath:           a.opts.Path,
		AutomaticReload:      a.opts.AutomaticReload,
		ActiveConfigHash:     g.cfg.Hash,
		FIPS:                 a.opts.Transformers.FIPS != transformers.FIPSOff,
		LoadedAt:             g.loadedAt,
		ReplacedPendingClose: a.pending.Load(),
		Resources:            g.set.Rules(),
		KMSProviders:         []transformers.KMSStatus{},
		KeyWrites:            a.opts.Transformers.WriteCounts.Snapshot(),
	}
	for _, k := range g.set.KMSProviders() {
		st.KMSProviders = append(st.KMSProviders, k.Status())
	}
	st.ReloadsSucceeded, st.ReloadsFailed = s.succeeded, s.failed
	st.LastAttemptAt = s.lastAttemptAt
	st.LastError, st.LastErrorAt, st.LastErrorConfigHash = s.lastErr, s.lastErrAt, s.lastErrHash
	return st
}

// Rules describes the resource rules of the active configuration (Status().Resources
// without the rest of the document).
func (a *Agent) Rules() []transformers.RuleInfo { return a.cur.Load().set.Rules() }

// ActiveConfig returns the configuration in use. Callers must not modify it.
func (a *Agent) ActiveConfig() *config.Config { return a.cur.Load().cfg }

// StatusHandler serves the status document as JSON on GET and HEAD.
func (a *Agent) StatusHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		body, err := json.MarshalIndent(a.Status(), "", "  ")
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store")
		if r.Method == http.MethodHead {
			return
		}
		_, _ = w.Write(append(body, '\n'))
	})
}
