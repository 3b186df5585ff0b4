package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/rekey-io/rekey/internal/configsource"
	"github.com/rekey-io/rekey/internal/rotation"
	"github.com/rekey-io/rekey/pkg/cluster"
)

// drive configures one driveRotation: what rotate --wait's flags say, and for
// `rekey controller` what the object's spec says.
type drive struct {
	request rotation.Request
	// prefix is the coordination prefix, validated by the caller.
	prefix   string
	timeout  time.Duration
	interval time.Duration
	// removeIdentity: rotation.Config.RemoveIdentity; resumeOnly: rotation.Config.ResumeOnly.
	removeIdentity, resumeOnly bool
	// stderr gets the warnings of the first edit.
	stderr io.Writer
}

// rotationRound is what one round of driveRotation read and decided.
type rotationRound struct {
	Ready rotation.Ready
	// File is the configuration as read this round.
	File *rotation.File
	// Members are the live apiservers' records; nil when etcd could not be read.
	Members []cluster.MemberState
}

// rotationObserver is told what driveRotation does. Lines carry names, hashes and
// counts only: the machine's output holds no key material.
type rotationObserver interface {
	// Line is a transition or an edit written.
	Line(s string)
	// Note is a transient problem that is retried.
	Note(s string)
	// Round is called after every round; an error stops the rotation with it (what was
	// written stays, and a new driveRotation resumes from it).
	Round(r rotationRound) error
	// Edited is called once an edit is in the source (first: the new key first; else
	// the second edit), before the machine is told; an error stops the rotation.
	Edited(first bool, e *rotation.Edit) error
}

// driveRotation runs rotation.Machine to the end: every interval it reads the source
// and the coordination keys in etcd, feeds them, and does what the machine asks (take
// an inventory, write the first or the second edit). rotate --wait and the controller
// both run it, with their own source (c.src) and observer. It returns nil once the
// rotation is complete, the machine's error when it fails, and ctx's when ctx ends.
func (c *common) driveRotation(ctx context.Context, d drive, obs rotationObserver) error {
	if d.interval <= 0 {
		d.interval = 500 * time.Millisecond
	}
	if d.stderr == nil {
		d.stderr = io.Discard
	}
	s, err := c.open(ctx, preamble{})
	if err != nil {
		return err
	}
	defer s.Close()

	m := rotation.New(rotation.Config{Timeout: d.timeout, RemoveIdentity: d.removeIdentity, ResumeOnly: d.resumeOnly}, time.Now())
	// kmsKeyIDs are the key id hashes this command's own KMS plugins report, by
	// provider name, from the last inventory: the key id a KMS rule's rotation waits for.
	var kmsKeyIDs map[string]string
	// stored resolves the file's rules into the resources stored under them (a wildcard
	// rule into what is stored), refreshed at every inventory.
	stored, err := c.scanStored(ctx, s.etcd)
	if err != nil {
		return err
	}
	r := d.request
	ticker := time.NewTicker(d.interval)
	defer ticker.Stop()
	for {
		m.Step(rotation.Tick{Now: time.Now()})
		f, err := c.readSource(ctx, "the configuration is not valid now, so rotate --wait stops (fix it and run it again)")
		if err != nil {
			return err
		}
		fr := withKeyIDs(f.Read(r, stored.resources), kmsKeyIDs)
		m.Step(fr)
		sctx, cancel := context.WithTimeout(ctx, c.timeout)
		snap, err := cluster.ReadSnapshot(sctx, s.etcd, d.prefix)
		cancel()
		var members []cluster.MemberState
		if err != nil {
			obs.Note(fmt.Sprintf("reading the cluster failed (retrying): %v", err))
		} else {
			members = snap.Members
			m.Step(rotation.ClusterObserved{Members: snap.Members, Migration: snap.Migration, Prefix: d.prefix})
		}
		rd := m.Ready()
		for _, l := range rd.Lines {
			obs.Line(l)
		}
		rd.Lines = nil
		if err := obs.Round(rotationRound{Ready: rd, File: f.File, Members: members}); err != nil {
			return err
		}
		switch rd.Action {
		case rotation.ActionDone:
			return nil
		case rotation.ActionFail:
			return fmt.Errorf("rotate --wait: %s", rd.Err)
		case rotation.ActionTakeInventory:
			if x, err := c.scanStored(ctx, s.etcd); err == nil {
				stored = x
				fr = withKeyIDs(f.Read(r, stored.resources), kmsKeyIDs)
			}
			counts, ids, err := c.storedCounts(ctx, s, f.File, fr)
			if err != nil {
				m.Step(rotation.InventoryFailed{Reason: oneLine(err.Error())})
				continue
			}
			kmsKeyIDs = ids
			m.Step(withKeyIDs(fr, kmsKeyIDs))
			m.Step(rotation.Inventoried{Resources: counts})
			continue
		case rotation.ActionWriteFirstEdit, rotation.ActionRemoveOld:
			if err := c.driveEdit(ctx, d, m, rd, f, obs); err != nil {
				return err
			}
			continue
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("rotate --wait: interrupted at %s; run it again to continue: %w", stageText(rd.Stage), ctx.Err())
		case <-ticker.C:
		}
	}
}

// driveEdit makes the edit rd asks for on f, the source as read for this decision, and
// reports the result to m: the first edit (a new write key), or the second (rd.Remove
// out, once the guard allows it; a refusal is the machine's to retry).
func (c *common) driveEdit(ctx context.Context, d drive, m *rotation.Machine, rd rotation.Ready, f sourced, obs rotationObserver) error {
	which := "first"
	r := d.request
	var e *rotation.Edit
	var err error
	if rd.Action == rotation.ActionRemoveOld {
		which = "second"
		e, err = c.removeKeys(ctx, f.File, rd.Remove, r.Resources)
	} else {
		r.Now = time.Now()
		e, err = c.addKey(ctx, d.stderr, f.File, r)
	}
	if err == nil {
		err = c.replaceSource(ctx, f, e)
	}
	switch {
	case errors.Is(err, configsource.ErrChanged):
		obs.Note(fmt.Sprintf("%s changed since it was read; reading it again before the %s edit", c.sourceName(), which))
		m.Step(rotation.EditSkipped{})
		return nil
	case err != nil && rd.Action == rotation.ActionRemoveOld:
		m.Step(removeRefused(err))
		return nil
	case err != nil:
		return fmt.Errorf("rotate --wait: writing the first edit: %w", err)
	}
	obs.Line(fmt.Sprintf("wrote %s: %s (%s)", c.sourceName(), e.Summary, e.Config.Hash))
	if err := obs.Edited(rd.Action == rotation.ActionWriteFirstEdit, e); err != nil {
		return err
	}
	if rd.Action == rotation.ActionRemoveOld {
		m.Step(rotation.RemoveWritten{})
	} else {
		m.Step(rotation.FirstEditWritten{})
	}
	return nil
}
