package main

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rekey-io/rekey/api/v1alpha1"
	"github.com/rekey-io/rekey/internal/rotation"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// The controller's decisions, without I/O: what a reconcile does with an object
// (decideReconcile), and how a rotation's rounds show in its status.

// ctrlDecision is what a reconcile of one object does when no rotation of it runs in
// this process.
type ctrlDecision struct {
	// Resume: the status records a rotation that is not over (this controller or
	// another stopped during it, or it failed and its retry is due): run it again.
	// ResumeOnly: its first edit is recorded, so the run must not add a key
	// (rotation.Config.ResumeOnly).
	Resume, ResumeOnly bool
	// Start: a new rotation, asked for by Triggers.
	Start    bool
	Triggers []v1alpha1.Trigger
	// TakeAnnotation: the rekey.io/operation=rotate annotation is taken: recorded in
	// the status (Start, or folded into the rotation Resume continues), then removed.
	TakeAnnotation bool
	// CheckWrites: nothing else asks for a rotation and spec.rotateIfWritesOver is set:
	// the apiservers' write totals in etcd decide (the caller reads them).
	CheckWrites bool
	// After is when to look again for a time-based reason (the rotation period, a
	// failed rotation's retry); 0: no such reason.
	After time.Duration
}

// decideReconcile decides from the object alone. Requests are folded: every
// rotationGeneration above the observed one, the annotation and a due period asked
// at once give one rotation; a request made while a rotation runs gives one more
// after it (rotationGeneration), or is folded into the running one (the annotation:
// it asks for a rotation now, and one is running).
func decideReconcile(o *v1alpha1.ControlPlaneEncryption, now time.Time, retryFailed time.Duration) ctrlDecision {
	var d ctrlDecision
	annotated := o.Annotations[v1alpha1.OperationAnnotation] == v1alpha1.OperationRotate
	st := &o.Status
	if st.Rotation != nil {
		d.TakeAnnotation = annotated
		if st.Phase == v1alpha1.PhaseFailed {
			if wait := failedAt(st).Add(retryFailed).Sub(now); wait > 0 && !annotated {
				d.After = wait
				return d
			}
		}
		d.Resume, d.ResumeOnly = true, st.Rotation.FirstEditWritten
		return d
	}
	if o.Spec.RotationGeneration > st.ObservedRotationGeneration {
		d.Triggers = append(d.Triggers, v1alpha1.TriggerGeneration)
	}
	if annotated {
		d.Triggers = append(d.Triggers, v1alpha1.TriggerAnnotation)
		d.TakeAnnotation = true
	}
	if p := o.Spec.RotationPeriod; p != nil && p.Duration > 0 {
		base := o.CreationTimestamp.Time
		if st.LastCompletionTime != nil {
			base = st.LastCompletionTime.Time
		}
		if due := base.Add(p.Duration); !now.Before(due) {
			d.Triggers = append(d.Triggers, v1alpha1.TriggerPeriod)
		} else {
			d.After = due.Sub(now)
		}
	}
	d.Start = len(d.Triggers) > 0
	d.CheckWrites = !d.Start && o.Spec.RotateIfWritesOver > 0
	return d
}

// failedAt is when the rotation failed: the condition's transition to Failed.
func failedAt(st *v1alpha1.ControlPlaneEncryptionStatus) time.Time {
	if c := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionEtcdDataEncryptionUpToDate); c != nil && c.Reason == v1alpha1.ReasonFailed {
		return c.LastTransitionTime.Time
	}
	return time.Time{}
}

// startRotation records a new rotation in st before anything is written: the
// generation taken, the triggers, the time.
func startRotation(o *v1alpha1.ControlPlaneEncryption, d ctrlDecision, now metav1.Time) {
	st := &o.Status
	st.ObservedGeneration = o.Generation
	st.ObservedRotationGeneration = max(st.ObservedRotationGeneration, o.Spec.RotationGeneration)
	st.Rotation = &v1alpha1.RotationRecord{Generation: st.ObservedRotationGeneration, Triggers: d.Triggers, StartedTime: now, Result: v1alpha1.ResultRunning}
	st.Phase, st.Stage, st.Message, st.Stragglers = v1alpha1.PhasePreparing, rotation.StageStart.String(), "", nil
	st.LastInitiationTime, st.LastInitiationFinishedTime, st.TargetKey = &now, nil, nil
	setCondition(o, metav1.ConditionFalse, v1alpha1.ReasonReEncryptionInProgress, "rotation started ("+triggerText(d.Triggers)+")", now)
}

func triggerText(ts []v1alpha1.Trigger) string {
	var s []string
	for _, t := range ts {
		s = append(s, string(t))
	}
	return strings.Join(s, ", ")
}

// foldAnnotation records the annotation as asking for the rotation that runs.
func foldAnnotation(st *v1alpha1.ControlPlaneEncryptionStatus) {
	if st.Rotation != nil && !slices.Contains(st.Rotation.Triggers, v1alpha1.TriggerAnnotation) {
		st.Rotation.Triggers = append(st.Rotation.Triggers, v1alpha1.TriggerAnnotation)
	}
}

func setCondition(o *v1alpha1.ControlPlaneEncryption, status metav1.ConditionStatus, reason, msg string, now metav1.Time) {
	if len(msg) > 32768 {
		msg = msg[:32768]
	}
	if msg == "" {
		msg = reason
	}
	meta.SetStatusCondition(&o.Status.Conditions, metav1.Condition{
		Type: v1alpha1.ConditionEtcdDataEncryptionUpToDate, Status: status, Reason: reason, Message: msg,
		ObservedGeneration: o.Generation, LastTransitionTime: now,
	})
}

// phaseOf maps rekey's stage to the object's phase (docs/controller.md): start, edit
// and promote prepare; migrate is Prepared until the migration leader reports
// progress, then Migrating; remove and ack complete.
func phaseOf(rd rotation.Ready) v1alpha1.Phase {
	switch rd.Stage {
	case rotation.StageMigrate:
		if rd.Progress.Total > 0 {
			return v1alpha1.PhaseMigrating
		}
		return v1alpha1.PhasePrepared
	case rotation.StageRemove, rotation.StageAck:
		return v1alpha1.PhaseCompleting
	case rotation.StageDone:
		return v1alpha1.PhaseCompleted
	case rotation.StageFailed:
		return v1alpha1.PhaseFailed
	}
	return v1alpha1.PhasePreparing
}

// applyRound shows one round of the rotation in o's status.
func applyRound(o *v1alpha1.ControlPlaneEncryption, r rotationRound, now metav1.Time) {
	st := &o.Status
	rd := r.Ready
	st.ObservedGeneration = o.Generation
	st.Stage, st.Phase, st.Message = rd.Stage.String(), phaseOf(rd), rd.Waiting
	if rd.Stage > rotation.StagePromote && rd.Stage <= rotation.StageDone && st.LastInitiationFinishedTime == nil {
		st.LastInitiationFinishedTime = &now
	}
	st.Stragglers = nil
	if r.File != nil && (rd.Stage == rotation.StagePromote || rd.Stage == rotation.StageAck) {
		st.Stragglers = stragglers(r.Members, r.File.Config.Hash)
	}
	if st.TargetKey != nil && st.TargetKey.Provider == transformers.ProviderKMSv2 && st.TargetKey.Fingerprint == "" {
		st.TargetKey.Fingerprint = kmsKeyIDOf(r.Members, st.TargetKey.Name)
	}
	switch {
	case rd.Action == rotation.ActionDone || rd.Action == rotation.ActionFail:
		// finishRotation writes these.
	case len(st.Stragglers) > 0:
		setCondition(o, metav1.ConditionFalse, v1alpha1.ReasonWaitingForAPIServers, rd.Waiting, now)
	default:
		setCondition(o, metav1.ConditionFalse, v1alpha1.ReasonReEncryptionInProgress, stageText(rd.Stage)+": "+dash(rd.Waiting), now)
	}
}

// stragglers are the live apiservers that do not run the configuration as it is now
// (hash), with what they published about it and what to do.
func stragglers(members []cluster.MemberState, hash string) []v1alpha1.Straggler {
	var out []v1alpha1.Straggler
	for _, m := range members {
		if m.ConfigHash == hash {
			continue
		}
		reason := fmt.Sprintf("runs configuration %s, not %s", shortHash(m.ConfigHash), shortHash(hash))
		if m.LastReloadError != "" {
			first, _, _ := strings.Cut(m.LastReloadError, "\n")
			reason += "; it refused a newer file: " + first
		} else {
			reason += "; its copy of the Secret has not changed yet (the kubelet updates a mounted Secret after its sync period; a subPath mount never is updated: mount the Secret as a directory, or restart that pod)"
		}
		out = append(out, v1alpha1.Straggler{APIServerID: m.APIServerID, Reason: reason})
	}
	slices.SortFunc(out, func(a, b v1alpha1.Straggler) int { return strings.Compare(a.APIServerID, b.APIServerID) })
	return out
}

// keyRef names key (a local key name or a KMS provider name) of cfg: its provider and
// fingerprint (a local key's check value; a KMS v2 key id hash as the apiservers
// publish it). Never key material. nil when cfg has no such key.
func keyRef(cfg *config.Config, key string, members []cluster.MemberState) *v1alpha1.KeyRef {
	for _, rule := range transformers.DescribeRules(cfg) {
		for _, k := range rule.ReadKeys {
			if k.Key != key || k.Provider == transformers.ProviderIdentity {
				continue
			}
			ref := &v1alpha1.KeyRef{Provider: k.Provider, Name: k.Key, Fingerprint: k.Check}
			if k.Provider == transformers.ProviderKMSv2 {
				ref.Fingerprint = kmsKeyIDOf(members, k.Key)
			}
			return ref
		}
	}
	return nil
}

// writeKeyRef is the key the first rule of cfg that writes with a key writes with.
func writeKeyRef(cfg *config.Config, members []cluster.MemberState) *v1alpha1.KeyRef {
	for _, rule := range transformers.DescribeRules(cfg) {
		if w, ok := rule.Writer(); ok && w.Provider != transformers.ProviderIdentity {
			return keyRef(cfg, w.Key, members)
		}
	}
	return nil
}

// kmsKeyIDOf is the key id hash the live members write with under KMS v2 provider name.
func kmsKeyIDOf(members []cluster.MemberState, name string) string {
	for _, m := range members {
		for _, r := range m.Resources {
			if r.Write.Provider == transformers.ProviderKMSv2 && r.Write.Key == name && r.Write.KeyIDHash != "" {
				return r.Write.KeyIDHash
			}
		}
	}
	return ""
}

// finishRotation records the end of the running rotation: completed (err nil), or
// failed with err (the rotation stays recorded, so a retry resumes it).
func finishRotation(o *v1alpha1.ControlPlaneEncryption, last rotationRound, err error, now metav1.Time) {
	st := &o.Status
	if st.Rotation == nil {
		st.Rotation = &v1alpha1.RotationRecord{Generation: st.ObservedRotationGeneration, Triggers: []v1alpha1.Trigger{v1alpha1.TriggerResume}, StartedTime: now}
	}
	rec := *st.Rotation
	rec.CompletionTime = &now
	st.ObservedGeneration = o.Generation
	st.Stragglers = nil
	if err != nil {
		msg := controllerWords(oneLine(err.Error()))
		rec.Result, rec.Message = v1alpha1.ResultFailed, msg
		st.Rotation.Message = msg
		st.Phase, st.Stage, st.Message = v1alpha1.PhaseFailed, rotation.StageFailed.String(), msg
		setCondition(o, metav1.ConditionFalse, v1alpha1.ReasonFailed, msg, now)
	} else {
		rec.Result, rec.Message = v1alpha1.ResultCompleted, ""
		if last.File != nil {
			if k := writeKeyRef(last.File.Config, last.Members); k != nil {
				st.ActiveKey = k
			}
		}
		if rec.Key == nil {
			rec.Key = st.ActiveKey
		}
		st.Rotation, st.TargetKey = nil, nil
		st.Phase, st.Stage, st.Message = v1alpha1.PhaseCompleted, rotation.StageDone.String(), ""
		st.LastCompletionTime = &now
		if st.LastInitiationFinishedTime == nil {
			st.LastInitiationFinishedTime = &now
		}
		msg := "every apiserver runs the configuration and every stored object is under the write key"
		if st.ActiveKey != nil {
			msg += fmt.Sprintf(" (%s %s)", st.ActiveKey.Provider, st.ActiveKey.Name)
		}
		setCondition(o, metav1.ConditionTrue, v1alpha1.ReasonCompleted, msg, now)
	}
	st.History = append([]v1alpha1.RotationRecord{rec}, st.History...)
	if len(st.History) > v1alpha1.HistoryLimit {
		st.History = st.History[:v1alpha1.HistoryLimit]
	}
}

// firstEditRecorded records the first edit in st: the new key is in the source.
func firstEditRecorded(o *v1alpha1.ControlPlaneEncryption, e *rotation.Edit, members []cluster.MemberState) {
	st := &o.Status
	if st.Rotation == nil {
		return
	}
	st.Rotation.FirstEditWritten = true
	st.TargetKey = keyRef(e.Config, e.NewKey, members)
	st.Rotation.Key = st.TargetKey
}

// controllerWords turns the advice rotate --wait prints (run it again) into what
// resumes a rotation under the controller.
func controllerWords(s string) string {
	s = strings.TrimPrefix(s, "rotate --wait: ")
	s = strings.ReplaceAll(s, "run rekey rotate --wait again for a new key", "raise spec.rotationGeneration for a new key")
	return strings.ReplaceAll(s, "run `rekey rotate --wait` again",
		"the controller resumes it (after --retry-failed-after, or at once with the annotation "+v1alpha1.OperationAnnotation+"="+v1alpha1.OperationRotate+")")
}
