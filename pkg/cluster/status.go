package cluster

import (
	"slices"
	"time"
)

// Status is the `cluster` section of the agent's status document. Names, hashes and
// times only.
type Status struct {
	APIServerID string `json:"apiserverID"`
	Prefix      string `json:"coordinationPrefix"`
	// ClusterID is the cluster's identity (<prefix>/cluster).
	ClusterID string `json:"clusterID,omitempty"`
	// Members are the live members as they published themselves.
	Members []MemberState `json:"members"`
	// UnknownMembers are records under the members prefix that are not live members of
	// this cluster: they hold promotions, never count against readiness.
	UnknownMembers []UnknownMember `json:"unknownMembers,omitempty"`
	// Holds are the write keys this apiserver's fence holds back.
	Holds []Hold `json:"holds,omitempty"`
	// MissingKeys are keys the cluster uses that this configuration cannot read (the
	// readyz check fails while there are any).
	MissingKeys []string `json:"missingKeys,omitempty"`
	// Warnings are entries of this configuration that another live member has with
	// another check value while nobody writes with them (Node.ReadinessWarnings):
	// readiness lets them pass, so they are reported here, and as an Event.
	Warnings []string `json:"warnings,omitempty"`
	Verdict  Verdict  `json:"verdict"`
	// MigrationLeader is set on the elected migration leader.
	MigrationLeader bool            `json:"migrationLeader"`
	Migration       *MigrationState `json:"migration,omitempty"`
	// DisagreeingSince is when this member saw the members start to disagree.
	DisagreeingSince time.Time `json:"disagreeingSince,omitzero"`
	// KeyWrites are the cluster's lifetime totals per key and when each was first seen
	// (KeyTotal), as this member last read them.
	KeyWrites []KeyTotal `json:"keyWrites,omitempty"`
	// KMSKeyIDReuses names the refused KMS key id reuses the members publish
	// (KMSKeyIDReuses).
	KMSKeyIDReuses []string `json:"kmsKeyIDReuses,omitempty"`
	// Conditions is "DisagreementAlarm" while the alarm is raised, and
	// ConditionKMSKeyIDReuse while a member's KMS plugin reports a refused reused key id.
	Conditions   []string `json:"conditions,omitempty"`
	PublishError string   `json:"publishError,omitempty"`
}

// Status returns the cluster section of the status document.
func (n *Node) Status() Status {
	now := n.opts.Clock.Now()
	st := Status{APIServerID: n.opts.ID, Prefix: n.opts.Prefix, Members: n.view.Members(), UnknownMembers: n.view.Unknown(), Holds: n.Holds()}
	n.mu.Lock()
	st.KeyWrites = slices.Clone(n.keyTotals)
	st.ClusterID = n.clusterID
	agent, mig := n.agent, n.migrator
	st.DisagreeingSince, st.PublishError = n.alarm.Since(), n.publishErr
	alarmed := n.alarm.Raised()
	n.mu.Unlock()
	if agent != nil {
		st.MissingKeys, st.Warnings = n.MissingKeys(), n.ReadinessWarnings()
	}
	if mig != nil {
		ms, leading := mig.State()
		st.Migration, st.MigrationLeader = &ms, leading
	}
	st.Verdict = Evaluate(st.Members, st.Migration, now, n.opts.DisagreementAlarm)
	if alarmed {
		st.Conditions = append(st.Conditions, "DisagreementAlarm")
	}
	if st.KMSKeyIDReuses = kmsKeyIDReuses(st.Members); len(st.KMSKeyIDReuses) > 0 {
		st.Conditions = append(st.Conditions, ConditionKMSKeyIDReuse)
	}
	return st
}
