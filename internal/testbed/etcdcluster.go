package testbed

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/freeport"
)

// EtcdCluster is a static etcd cluster of separate processes on loopback, each
// member with its own ports and data dir, fsync off. Members can be stopped, killed
// and restarted; a restarted member keeps its data dir and rejoins.
type EtcdCluster struct {
	// Members are in the order of the initial cluster; their client URLs never change.
	Members []*EtcdMember
}

// EtcdMember is one member of an EtcdCluster.
type EtcdMember struct {
	Name string
	// Endpoint is the client URL; it stays the same across restarts.
	Endpoint string
	// PeerURL is the peer URL.
	PeerURL string
	// DataDir holds the member's data; Restart reuses it.
	DataDir string

	bin, logDir string
	args        []string

	mu   sync.Mutex
	proc *Process
	// stopped is set when a test stops or kills the member, so that WaitHealthy tells
	// a crash from an intended stop.
	stopped bool
}

// StartEtcdCluster starts an n-member etcd cluster with its data and logs under dir
// and waits until it has a leader and serves linearizable reads.
// A start that lost a port to another process is tried again on new ports
// (retryLostPort).
func StartEtcdCluster(ctx context.Context, bin, dir string, n int) (*EtcdCluster, error) {
	if n < 1 {
		return nil, fmt.Errorf("etcd cluster of %d members: need at least one", n)
	}
	return retryLostPort(func() (*EtcdCluster, error) {
		for i := range n {
			if err := os.RemoveAll(filepath.Join(dir, "etcd-"+strconv.Itoa(i))); err != nil {
				return nil, err
			}
		}
		return startEtcdCluster(ctx, bin, dir, n)
	})
}

func startEtcdCluster(ctx context.Context, bin, dir string, n int) (*EtcdCluster, error) {
	c := &EtcdCluster{}
	var initial []string
	// Distinct ports for every member's client and peer URLs.
	ports, err := freeport.PickN(2 * n)
	if err != nil {
		return nil, err
	}
	for i := range n {
		cport, pport := ports[2*i], ports[2*i+1]
		m := &EtcdMember{
			Name:     "etcd-" + strconv.Itoa(i),
			Endpoint: "http://127.0.0.1:" + strconv.Itoa(cport),
			PeerURL:  "http://127.0.0.1:" + strconv.Itoa(pport),
			DataDir:  filepath.Join(dir, "etcd-"+strconv.Itoa(i)),
			bin:      bin,
			logDir:   dir,
		}
		initial = append(initial, m.Name+"="+m.PeerURL)
		c.Members = append(c.Members, m)
	}
	token := fmt.Sprintf("testbed-%d", time.Now().UnixNano())
	for _, m := range c.Members {
		if err := os.MkdirAll(m.DataDir, 0o700); err != nil {
			return nil, err
		}
		// The initial-cluster flags matter only on the first start; a restart with a
		// data dir rejoins from the member's own WAL.
		m.args = []string{
			"--name", m.Name, "--data-dir", m.DataDir,
			"--listen-client-urls", m.Endpoint, "--advertise-client-urls", m.Endpoint,
			"--listen-peer-urls", m.PeerURL, "--initial-advertise-peer-urls", m.PeerURL,
			"--initial-cluster", strings.Join(initial, ","),
			"--initial-cluster-state", "new", "--initial-cluster-token", token,
			"--unsafe-no-fsync", "--log-level", "warn",
		}
	}
	for _, m := range c.Members {
		if err := m.start(); err != nil {
			c.Kill()
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if err := c.WaitHealthy(ctx); err != nil {
		tails := c.logTails(2000)
		c.Kill()
		return nil, fmt.Errorf("etcd cluster not healthy: %w\n%s", err, tails)
	}
	return c, nil
}

func (m *EtcdMember) start() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.proc != nil {
		select {
		case <-m.proc.Done():
		default:
			return fmt.Errorf("%s is already running", m.Name)
		}
	}
	// etcd runs outside FIPS mode (fixtureRunEnv): it computes member ids with SHA-1.
	p, err := StartEnv(m.Name, m.logDir, m.bin, fixtureRunEnv(), m.args...)
	if err != nil {
		return err
	}
	m.proc = p
	m.stopped = false
	return nil
}

// Process is the member's current process (nil before the first start).
func (m *EtcdMember) Process() *Process {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.proc
}

// Running reports whether the member's process is alive.
func (m *EtcdMember) Running() bool {
	p := m.Process()
	if p == nil {
		return false
	}
	select {
	case <-p.Done():
		return false
	default:
		return true
	}
}

// Stop shuts the member down with SIGTERM (SIGKILL after 10 s).
func (m *EtcdMember) Stop() {
	m.markStopped()
	if p := m.Process(); p != nil {
		p.Stop(10 * time.Second)
	}
}

// Kill kills the member with SIGKILL.
func (m *EtcdMember) Kill() {
	m.markStopped()
	if p := m.Process(); p != nil {
		p.Kill()
	}
}

func (m *EtcdMember) markStopped() {
	m.mu.Lock()
	m.stopped = true
	m.mu.Unlock()
}

// crashed reports a member that exited without a test stopping it.
func (m *EtcdMember) crashed() bool {
	m.mu.Lock()
	stopped := m.stopped
	m.mu.Unlock()
	return !stopped && m.Process() != nil && !m.Running()
}

// Restart starts a stopped member again on its data dir and ports; it rejoins the
// cluster and catches up from the leader. It does not wait: see WaitHealthy and
// WaitCaughtUp.
func (m *EtcdMember) Restart() error {
	if m.Running() {
		return fmt.Errorf("%s is still running: stop or kill it first", m.Name)
	}
	return m.start()
}

// Endpoints are all members' client URLs, stopped ones included (clients fail over).
func (c *EtcdCluster) Endpoints() []string {
	out := make([]string, len(c.Members))
	for i, m := range c.Members {
		out[i] = m.Endpoint
	}
	return out
}

// RunningEndpoints are the client URLs of the members whose process is alive.
func (c *EtcdCluster) RunningEndpoints() []string {
	var out []string
	for _, m := range c.Members {
		if m.Running() {
			out = append(out, m.Endpoint)
		}
	}
	return out
}

// Client connects to all members.
func (c *EtcdCluster) Client() (*clientv3.Client, error) { return EtcdClient(c.Endpoints()) }

// Stop stops every member.
func (c *EtcdCluster) Stop() {
	var wg sync.WaitGroup
	for _, m := range c.Members {
		wg.Go(m.Stop)
	}
	wg.Wait()
}

// Kill kills every member.
func (c *EtcdCluster) Kill() {
	for _, m := range c.Members {
		m.Kill()
	}
}

// Health checks that a quorum of members is running, that every running member
// answers and names the same leader, and that a linearizable read succeeds.
func (c *EtcdCluster) Health(ctx context.Context) error {
	running := c.RunningEndpoints()
	if len(running) <= len(c.Members)/2 {
		return fmt.Errorf("%d of %d members running: no quorum", len(running), len(c.Members))
	}
	cli, err := EtcdClient(running)
	if err != nil {
		return err
	}
	defer cli.Close()
	var leader uint64
	for _, ep := range running {
		sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		st, err := cli.Status(sctx, ep)
		cancel()
		if err != nil {
			return fmt.Errorf("%s: %w", ep, err)
		}
		if st.Leader == 0 {
			return fmt.Errorf("%s: no leader", ep)
		}
		if leader != 0 && st.Leader != leader {
			return fmt.Errorf("%s: leader %x, another member says %x", ep, st.Leader, leader)
		}
		leader = st.Leader
	}
	gctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	_, err = cli.Get(gctx, "testbed-health")
	return err
}

// RaftTerm is the highest raft term the running members report. Every leader election
// raises it (etcd's pre-vote keeps a member that only lost touch from raising it), so
// two readings tell whether the cluster elected a leader between them.
func (c *EtcdCluster) RaftTerm(ctx context.Context) (uint64, error) {
	cli, err := EtcdClient(c.RunningEndpoints())
	if err != nil {
		return 0, err
	}
	defer cli.Close()
	var term uint64
	var errs []error
	for _, m := range c.Members {
		if !m.Running() {
			continue
		}
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		st, err := cli.Status(sctx, m.Endpoint)
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", m.Name, err))
			continue
		}
		term = max(term, st.RaftTerm)
	}
	if term == 0 {
		return 0, fmt.Errorf("no member reported its raft term: %w", errors.Join(errs...))
	}
	return term, nil
}

// Leader is the member that leads the cluster now, as the running members report.
func (c *EtcdCluster) Leader(ctx context.Context) (*EtcdMember, error) {
	cli, err := EtcdClient(c.RunningEndpoints())
	if err != nil {
		return nil, err
	}
	defer cli.Close()
	for _, m := range c.Members {
		if !m.Running() {
			continue
		}
		sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		st, err := cli.Status(sctx, m.Endpoint)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", m.Name, err)
		}
		if st.Leader != 0 && st.Leader == st.Header.MemberId {
			return m, nil
		}
	}
	return nil, errors.New("no running member says it leads the cluster")
}

// WaitHealthy polls Health until it passes or ctx ends; a member that exited
// without being stopped ends the wait with its log.
func (c *EtcdCluster) WaitHealthy(ctx context.Context) error {
	for {
		err := c.Health(ctx)
		if err == nil {
			return nil
		}
		for _, m := range c.Members {
			if m.crashed() {
				p := m.Process()
				return fmt.Errorf("%s exited (%v); log tail:\n%s", m.Name, p.ExitErr(), p.Log(4000))
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// WaitCaughtUp waits until member m has applied at least the cluster's current
// revision, as a serializable (local) read on m shows.
func (c *EtcdCluster) WaitCaughtUp(ctx context.Context, m *EtcdMember) error {
	cli, err := EtcdClient(c.RunningEndpoints())
	if err != nil {
		return err
	}
	defer cli.Close()
	gctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	resp, err := cli.Get(gctx, "testbed-health")
	cancel()
	if err != nil {
		return err
	}
	want := resp.Header.Revision
	local, err := EtcdClient([]string{m.Endpoint})
	if err != nil {
		return err
	}
	defer local.Close()
	for {
		gctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		r, err := local.Get(gctx, "testbed-health", clientv3.WithSerializable())
		cancel()
		if err == nil && r.Header.Revision >= want {
			return nil
		}
		if err == nil {
			err = fmt.Errorf("%s at revision %d, cluster at %d", m.Name, r.Header.Revision, want)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (c *EtcdCluster) logTails(max int) string {
	var b strings.Builder
	for _, m := range c.Members {
		if p := m.Process(); p != nil {
			fmt.Fprintf(&b, "--- %s:\n%s\n", m.Name, p.Log(max))
		}
	}
	return b.String()
}
