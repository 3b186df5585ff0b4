package reload

import (
	"encoding/json"
	"net/http"
	"time"

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
}

// Status returns the status document.
func (a *Agent) Status() Status {
	a.stateMu.Lock()
	g := a.cur.Load()
	s := a.state
	a.stateMu.Unlock()
	st := Status{
		ConfigPath:           a.opts.Path,
		AutomaticReload:      a.opts.AutomaticReload,
		ActiveConfigHash:     g.cfg.Hash,
		LoadedAt:             g.loadedAt,
		ReplacedPendingClose: a.pending.Load(),
		Resources:            g.set.Rules(),
		KMSProviders:         []transformers.KMSStatus{},
	}
	for _, k := range g.set.KMSProviders() {
		st.KMSProviders = append(st.KMSProviders, k.Status())
	}
	st.ReloadsSucceeded, st.ReloadsFailed = s.succeeded, s.failed
	st.LastAttemptAt = s.lastAttemptAt
	st.LastError, st.LastErrorAt, st.LastErrorConfigHash = s.lastErr, s.lastErrAt, s.lastErrHash
	return st
}

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
