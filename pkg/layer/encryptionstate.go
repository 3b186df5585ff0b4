package layer

import (
	"slices"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/encryptionstate"
)

// SetEncryptionStatePublisher makes the layer keep the cluster's EncryptionState
// (rekey.io/v1alpha1) current through p while this apiserver is the migration leader
// (pkg/encryptionstate). The binary calls it once it has built p, before the server
// runs: the shim's p is its built-in storage, made after the server; the distribution's
// writes through the loopback client. nil, the default, publishes nothing.
func (l *Layer) SetEncryptionStatePublisher(p encryptionstate.Publisher) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.statePublisher = p
}

// EncryptionStateStats are what keeping the EncryptionState current cost this
// apiserver so far (zero when it publishes none).
func (l *Layer) EncryptionStateStats() encryptionstate.Stats {
	l.mu.Lock()
	k := l.stateKeeper
	l.mu.Unlock()
	if k == nil {
		return encryptionstate.Stats{}
	}
	return k.Stats()
}

// newStateKeeper is the keeper of the EncryptionState, or nil without a publisher.
// mig is the elected migrator (nil without coordination or storage migration).
func (l *Layer) newStateKeeper(mig *cluster.Migrator) *encryptionstate.Keeper {
	l.mu.Lock()
	p := l.statePublisher
	l.mu.Unlock()
	if p == nil || l.agent == nil {
		return nil
	}
	m, err := encryptionstate.NewMetrics(l.opts.Registry)
	if err != nil {
		// A second keeper in one registry (a restarted hook): count nothing rather
		// than fail the server over metrics.
		l.log.V(2).Info("EncryptionState metrics not registered", "err", err)
		m = nil
	}
	agent, node, id, fips := l.agent, l.node, l.opts.memberID(), l.opts.fipsMode()
	return encryptionstate.NewKeeper(encryptionstate.KeeperOptions{
		Publisher: p,
		Leading:   func() bool { return leadsEncryptionState(mig, node) },
		Input: func() encryptionstate.Input {
			in := encryptionstate.Input{ObservedBy: id, Config: agent.ActiveConfig(), FIPS: fips, Inventory: l.store.Latest(), Ledger: l.ledger.Load()}
			if node != nil {
				in.Members, in.Totals = node.Members(), node.KeyTotals()
			}
			return in
		},
		Metrics: m,
		Logger:  l.log,
	})
}

// leadsEncryptionState says whether this apiserver writes the EncryptionState: the
// elected migration leader; without storage migration (no election) the live member
// with the lowest id, so that one apiserver writes; alone (no coordination), itself.
func leadsEncryptionState(mig *cluster.Migrator, node *cluster.Node) bool {
	if mig != nil {
		_, leading := mig.State()
		return leading
	}
	if node == nil {
		return true
	}
	ids := []string{}
	for _, m := range node.Members() {
		ids = append(ids, m.APIServerID)
	}
	return len(ids) > 0 && slices.Min(ids) == node.ID()
}
