package cluster

import (
	"fmt"
	"time"
)

// maxMemberRecordBytes bounds an encoded member record. etcd refuses a request larger
// than its --max-request-bytes (1.5 MiB by default), and a member whose Put is refused
// loses its lease and vanishes from every other apiserver's view while it keeps
// serving — the fences would promote without it. A record of a large configuration
// (hundreds of rules, several keys each) is tens of KiB; what can grow without bound
// is error text, and every apiserver reads every record on each change, so the bound
// sits well below etcd's limit.
const maxMemberRecordBytes = 64 << 10

// Names in MemberState.Reduced of the texts a record can lose.
const (
	reducedReloadError = "lastReloadError"
	reducedKMSErrors   = "kms.lastError"
)

// encodeRecord encodes st for its Put, reduced when the whole record exceeds max
// bytes: first the refused reload's error text goes, then the KMS providers' error
// texts, each replaced by a note and named in Reduced. Resources, keys and KMS key ids
// are what the other apiservers' fences and readiness decide on, so they are always
// published: a record is reduced, never dropped. Should it still be too large, it is
// returned as it is and etcd's answer decides (a member that cannot publish fails its
// own readiness).
func encodeRecord(st MemberState, max int) ([]byte, MemberState, error) {
	data, err := st.Marshal()
	if err != nil || len(data) <= max {
		return data, st, err
	}
	note := fmt.Sprintf("(cut: the member record exceeded %d bytes; see this apiserver's status document)", max)
	if st.LastReloadError != "" {
		st.LastReloadError = note
		st.Reduced = append(st.Reduced, reducedReloadError)
		if data, err = st.Marshal(); err != nil || len(data) <= max {
			return data, st, err
		}
	}
	kms, cut := make([]KMSState, len(st.KMS)), false
	for i, k := range st.KMS {
		if k.LastError != "" {
			k.LastError, cut = note, true
		}
		kms[i] = k
	}
	if cut {
		st.KMS = kms
		st.Reduced = append(st.Reduced, reducedKMSErrors)
		data, err = st.Marshal()
	}
	return data, st, err
}

// publishFailure is the readiness failure of a member that has not been able to publish
// its record for longer than its lease TTL: its lease has expired, so the other
// apiservers no longer count it — their fences may promote keys it cannot read, and
// `rekey rotate --wait` may finish without it — while it keeps serving.
func (n *Node) publishFailure() error {
	now := n.opts.Clock.Now()
	n.mu.Lock()
	since, why := n.publishFailingSince, n.publishErr
	n.mu.Unlock()
	if since.IsZero() || now.Sub(since) <= n.opts.LeaseTTL {
		return nil
	}
	return fmt.Errorf("this apiserver has not been able to publish its encryption state under %s for %s, longer than its %s lease, "+
		"so the other apiservers no longer count it and may start writing with keys it cannot read: %s; check the connection to etcd",
		membersPrefix(n.opts.Prefix), now.Sub(since).Round(time.Second), n.opts.LeaseTTL, why)
}
