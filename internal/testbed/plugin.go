package testbed

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

// Plugin is a kms-plugin process (cmd/kms-plugin).
type Plugin struct {
	*Process
	// Endpoint is the gRPC address for the encryption config: unix:///…/kms.sock.
	Endpoint string
	// Socket is the socket's file path.
	Socket string
	// KeysFile is the keyring; rewriting it rotates the key.
	KeysFile string
	// ControlURL is the fault-injection API base URL.
	ControlURL string
}

// PluginKey is one key-encryption key of the plugin's keyring.
type PluginKey struct {
	Name   string `json:"name"`
	Secret string `json:"secret"`
}

// WritePluginKeys writes a keyring file (the first key is active).
func WritePluginKeys(path string, keys ...PluginKey) error {
	b, err := json.Marshal(map[string]any{"keys": keys})
	if err != nil {
		return err
	}
	return WriteFileAtomic(path, b)
}

// PluginSocket returns a short socket path in sockDir (unix socket paths are limited
// to 107 bytes; test temp dirs can be longer).
func PluginSocket(sockDir string) string { return filepath.Join(sockDir, "kms.sock") }

// StartPlugin starts the plugin with keys, its socket in sockDir and its log in dir,
// and waits until the socket exists. With no keys it reuses dir's keys file, as a
// restarted plugin would.
func StartPlugin(ctx context.Context, bin, dir, sockDir string, keys ...PluginKey) (*Plugin, error) {
	return startPlugin(ctx, bin, dir, sockDir, nil, keys)
}

// StartPluginArgs is StartPlugin with more kms-plugin flags (e.g. --faults, for a fault
// about the first calls after a start).
func StartPluginArgs(ctx context.Context, bin, dir, sockDir string, args []string, keys ...PluginKey) (*Plugin, error) {
	return startPlugin(ctx, bin, dir, sockDir, args, keys)
}

// StartPluginV1 is StartPlugin for a plugin serving the KMS v1 API (--api-version v1):
// the plugin of a cluster that still holds KMS v1 values.
func StartPluginV1(ctx context.Context, bin, dir, sockDir string, keys ...PluginKey) (*Plugin, error) {
	return startPlugin(ctx, bin, dir, sockDir, []string{"--api-version", "v1"}, keys)
}

func startPlugin(ctx context.Context, bin, dir, sockDir string, args []string, keys []PluginKey) (*Plugin, error) {
	keysFile := filepath.Join(dir, "kms-keys.json")
	if len(keys) > 0 {
		if err := WritePluginKeys(keysFile, keys...); err != nil {
			return nil, err
		}
	}
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	sock := PluginSocket(sockDir)
	pl := &Plugin{Endpoint: "unix://" + sock, Socket: sock, KeysFile: keysFile,
		ControlURL: "http://127.0.0.1:" + strconv.Itoa(port)}
	p, err := Start("kms-plugin", dir, bin, append([]string{"--listen-addr", pl.Endpoint, "--keys-file", keysFile,
		"--control-addr", "127.0.0.1:" + strconv.Itoa(port)}, args...)...)
	if err != nil {
		return nil, err
	}
	pl.Process = p
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := poll(ctx, p, 10*time.Millisecond, func() error { _, err := os.Stat(sock); return err }); err != nil {
		p.Kill()
		return nil, fmt.Errorf("kms-plugin not listening: %w", err)
	}
	return pl, nil
}

// SetFaults replaces the plugin's injected faults (a JSON object such as
// {"failEncrypt":true}); nil clears them.
func (p *Plugin) SetFaults(ctx context.Context, faults map[string]any) error {
	method, body := http.MethodPut, []byte(nil)
	if faults == nil {
		method = http.MethodDelete
	} else {
		var err error
		if body, err = json.Marshal(faults); err != nil {
			return err
		}
	}
	req, err := http.NewRequestWithContext(ctx, method, p.ControlURL+"/faults", bytes.NewReader(body))
	if err != nil {
		return err
	}
	// The control API refuses state changes not declared JSON (a CSRF guard).
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("set faults: %s", resp.Status)
	}
	return nil
}
