package kmscheck

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/rekey-io/rekey/pkg/transformers/kmsdial"
)

// stopGrace is how long a plugin has to exit after SIGTERM before it gets SIGKILL.
const stopGrace = 5 * time.Second

// readyPoll is how often a starting plugin's socket is tried.
const readyPoll = 20 * time.Millisecond

// PluginProcess is a plugin kms-check started itself, so that it can restart it: a
// shell command in a process group of its own, so that stopping it also stops whatever
// the command started (a wrapper script's plugin).
type PluginProcess struct {
	command  string
	endpoint string
	ready    time.Duration
	stderr   io.Writer
	cmd      *exec.Cmd
	exited   chan struct{}
	waitErr  error
}

// StartPlugin runs command with sh -c and returns once endpoint accepts connections
// (within ready). The caller must Stop it, also when StartPlugin's caller fails later.
func StartPlugin(ctx context.Context, command, endpoint string, ready time.Duration, stderr io.Writer) (*PluginProcess, error) {
	if _, err := kmsdial.ParseEndpoint(endpoint); err != nil {
		return nil, err
	}
	p := &PluginProcess{command: command, endpoint: endpoint, ready: ready, stderr: stderr}
	if err := p.start(ctx); err != nil {
		return nil, err
	}
	return p, nil
}

func (p *PluginProcess) start(ctx context.Context) error {
	cmd := exec.Command("sh", "-c", p.command)
	cmd.Stdout, cmd.Stderr = p.stderr, p.stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("cannot start the plugin command %q: %w", p.command, err)
	}
	p.cmd, p.exited = cmd, make(chan struct{})
	go func(exited chan struct{}) {
		p.waitErr = cmd.Wait()
		close(exited)
	}(p.exited)
	if err := p.waitReady(ctx); err != nil {
		p.Stop()
		return err
	}
	return nil
}

// waitReady polls the socket: the plugin is ready once it accepts a connection.
func (p *PluginProcess) waitReady(ctx context.Context) error {
	addr, _ := kmsdial.ParseEndpoint(p.endpoint)
	deadline := time.Now().Add(p.ready)
	for {
		var d net.Dialer
		dctx, cancel := context.WithTimeout(ctx, readyPoll*5)
		conn, err := d.DialContext(dctx, "unix", addr)
		cancel()
		if err == nil {
			_ = conn.Close()
			return nil
		}
		select {
		case <-p.exited:
			return fmt.Errorf("the plugin command %q exited before listening on %s (%v); run it by hand to see why", p.command, p.endpoint, p.waitErr)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(readyPoll):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the plugin command %q did not listen on %s within %s; check that it serves that endpoint, or raise --timeout", p.command, p.endpoint, p.ready)
		}
	}
}

// Restart stops the plugin and starts it again; it returns once it listens.
func (p *PluginProcess) Restart(ctx context.Context) error {
	p.Stop()
	return p.start(ctx)
}

// Stop ends the plugin's process group: SIGTERM, then SIGKILL after stopGrace. It is
// safe to call more than once.
func (p *PluginProcess) Stop() {
	if p.cmd == nil || p.cmd.Process == nil {
		return
	}
	select {
	case <-p.exited:
		return
	default:
	}
	pgid := p.cmd.Process.Pid
	_ = syscall.Kill(-pgid, syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(stopGrace):
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		<-p.exited
	}
	// The group may outlive its leader (a plugin the command started in the
	// background); it was asked to stop, now it is made to.
	if err := syscall.Kill(-pgid, 0); err == nil || !errors.Is(err, syscall.ESRCH) {
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
	}
}

// EndpointFromCommand is the endpoint a kms-plugin command line listens on: the value
// of its --listen-addr (or -listen-addr) flag, "" when it has none.
func EndpointFromCommand(command string) string {
	words := strings.Fields(command)
	for i, w := range words {
		name, value, hasValue := strings.Cut(strings.TrimLeft(w, "-"), "=")
		if !strings.HasPrefix(w, "-") || name != "listen-addr" {
			continue
		}
		if hasValue {
			return strings.Trim(value, `'"`)
		}
		if i+1 < len(words) {
			return strings.Trim(words[i+1], `'"`)
		}
	}
	return ""
}
