package testbed

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/client-go/kubernetes"
)

// FleetConfig configures a Fleet.
type FleetConfig struct {
	// ShimBin is the apiserver-shim binary.
	ShimBin string
	// Dir holds one directory per shim (fleet-0, fleet-1, ...).
	Dir string
	// N is the number of shims.
	N int
	// EtcdServers, EtcdPrefix and Layer are every shim's.
	EtcdServers []string
	EtcdPrefix  string
	Layer       string
	// Config is the initial content of every shim's encryption config file;
	// ConfigFor, when set, gives shim i's instead (a KMS endpoint differs per node).
	Config    []byte
	ConfigFor func(i int) []byte
	// SyncMode is the layout of the config files (default SyncSymlinkSwap, so that a
	// FileSyncer on ConfigPaths behaves like kubelets).
	SyncMode SyncMode
	// Args are every shim's extra flags; ArgsFor(i), when set, adds shim i's own.
	Args    []string
	ArgsFor func(i int) []string
	// IDPrefix names the shims and their --apiserver-id: <IDPrefix>-<i> (default
	// "apiserver"). NoAPIServerID leaves --apiserver-id off, for a shim that does
	// not know the flag.
	IDPrefix      string
	NoAPIServerID bool
}

// Fleet is N shims on one etcd, each with its own copy of the encryption config
// file, as N kube-apiservers on N control-plane nodes.
type Fleet struct {
	Shims []*FleetShim
	cfg   FleetConfig
}

// FleetShim is one shim of a Fleet: its configuration, its config file and its
// current process (replaced on restart). It is "in rotation" (a load balancer sends
// it traffic) from a successful WaitReady until Kill or Stop, or until a test takes
// it out.
type FleetShim struct {
	Index int
	// ID is its --apiserver-id and process name.
	ID string
	// ConfigPath is the file the shim reads as --encryption-provider-config.
	ConfigPath string
	// Config is what StartShim is given (Args included).
	Config ShimConfig

	bin        string
	mu         sync.Mutex
	shim       *Shim
	client     *kubernetes.Clientset
	inRotation atomic.Bool
}

// StartFleet writes each shim's config file and starts the shims in parallel, then
// waits until every one is ready.
func StartFleet(ctx context.Context, c FleetConfig) (*Fleet, error) {
	if c.N < 1 {
		return nil, fmt.Errorf("fleet of %d shims: need at least one", c.N)
	}
	if c.IDPrefix == "" {
		c.IDPrefix = "apiserver"
	}
	f := &Fleet{cfg: c}
	for i := range c.N {
		id := c.IDPrefix + "-" + strconv.Itoa(i)
		dir := filepath.Join(c.Dir, id)
		path := filepath.Join(dir, "config", "encryption.yaml")
		content := c.Config
		if c.ConfigFor != nil {
			content = c.ConfigFor(i)
		}
		if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
			return nil, err
		}
		if err := writeSynced(c.SyncMode, path, content); err != nil {
			return nil, err
		}
		args := append([]string(nil), c.Args...)
		if c.ArgsFor != nil {
			args = append(args, c.ArgsFor(i)...)
		}
		sc := ShimConfig{Name: id, Dir: dir, EncryptionConfig: path, EtcdServers: c.EtcdServers,
			EtcdPrefix: c.EtcdPrefix, Layer: c.Layer, Args: args}
		if !c.NoAPIServerID {
			sc.APIServerID = id
		}
		f.Shims = append(f.Shims, &FleetShim{Index: i, ID: id, ConfigPath: path, Config: sc, bin: c.ShimBin})
	}
	errs := make([]error, c.N)
	var wg sync.WaitGroup
	for i, s := range f.Shims {
		wg.Go(func() {
			if errs[i] = s.Launch(ctx); errs[i] == nil {
				wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
				errs[i] = s.WaitReady(wctx)
				cancel()
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		f.Stop()
		return nil, err
	}
	return f, nil
}

// ConfigPaths are the shims' config files, by index: the files a FileSyncer updates.
func (f *Fleet) ConfigPaths() []string {
	out := make([]string, len(f.Shims))
	for i, s := range f.Shims {
		out[i] = s.ConfigPath
	}
	return out
}

// NewSyncer returns a FileSyncer over the fleet's config files in the fleet's mode.
func (f *Fleet) NewSyncer(c SyncerConfig) (*FileSyncer, error) {
	c.Files = f.ConfigPaths()
	c.Mode = f.cfg.SyncMode
	return NewFileSyncer(c)
}

// Endpoints are the shims as workload endpoints.
func (f *Fleet) Endpoints() []Endpoint {
	out := make([]Endpoint, len(f.Shims))
	for i, s := range f.Shims {
		out[i] = s
	}
	return out
}

// Running are the shims whose process is alive.
func (f *Fleet) Running() []*Shim {
	var out []*Shim
	for _, s := range f.Shims {
		if sh := s.Current(); sh != nil && s.Alive() {
			out = append(out, sh)
		}
	}
	return out
}

// Stop stops every shim.
func (f *Fleet) Stop() {
	var wg sync.WaitGroup
	for _, s := range f.Shims {
		wg.Go(func() { s.Stop(15 * time.Second) })
	}
	wg.Wait()
}

// LogTails returns the end of every shim's log, for a failing test.
func (f *Fleet) LogTails(max int) string {
	var out string
	for _, s := range f.Shims {
		if sh := s.Current(); sh != nil {
			out += fmt.Sprintf("--- %s:\n%s\n", s.ID, sh.Log(max))
		}
	}
	return out
}

// Launch starts the shim's process (again), out of rotation until WaitReady. The
// config file is left as it is: a restarted shim reads whatever its file says.
func (s *FleetShim) Launch(ctx context.Context) error {
	if s.Alive() {
		return fmt.Errorf("%s is running: stop or kill it first", s.ID)
	}
	sh, err := LaunchShim(ctx, s.bin, s.Config)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.shim, s.client = sh, nil
	s.mu.Unlock()
	return nil
}

// WaitReady waits until /readyz answers 200 and puts the shim into rotation.
func (s *FleetShim) WaitReady(ctx context.Context) error {
	sh := s.Current()
	if sh == nil {
		return fmt.Errorf("%s was never started", s.ID)
	}
	if err := sh.WaitReady(ctx); err != nil {
		return err
	}
	s.inRotation.Store(true)
	return nil
}

// Current is the shim's current process (nil before Launch).
func (s *FleetShim) Current() *Shim {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.shim
}

// Alive reports whether the current process runs.
func (s *FleetShim) Alive() bool {
	sh := s.Current()
	if sh == nil {
		return false
	}
	select {
	case <-sh.Done():
		return false
	default:
		return true
	}
}

// Kill takes the shim out of rotation and kills it (SIGKILL).
func (s *FleetShim) Kill() {
	s.inRotation.Store(false)
	if sh := s.Current(); sh != nil {
		sh.Kill()
	}
}

// Stop takes the shim out of rotation and stops it (SIGTERM, then SIGKILL after
// timeout).
func (s *FleetShim) Stop(timeout time.Duration) {
	s.inRotation.Store(false)
	if sh := s.Current(); sh != nil {
		sh.Stop(timeout)
	}
}

// SetInRotation puts the shim into or out of rotation by hand.
func (s *FleetShim) SetInRotation(in bool) { s.inRotation.Store(in) }

// Name implements Endpoint.
func (s *FleetShim) Name() string { return s.ID }

// InRotation implements Endpoint: the shim is alive and a load balancer would send
// it traffic.
func (s *FleetShim) InRotation() bool { return s.inRotation.Load() && s.Alive() }

// Client implements Endpoint: a clientset for the current process.
func (s *FleetShim) Client() (kubernetes.Interface, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.shim == nil {
		return nil, fmt.Errorf("%s was never started", s.ID)
	}
	if s.client == nil {
		c, err := kubernetes.NewForConfig(s.shim.RESTConfig())
		if err != nil {
			return nil, err
		}
		s.client = c
	}
	return s.client, nil
}
