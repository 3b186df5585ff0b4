package kmsplugin

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// CheckListenAddr applies the socket rules every KMS plugin of this repository
// follows to endpoint (unix:///path.sock or unix:///@abstract-name; empty means
// DefaultListenAddr, whose directory it creates 0700) and returns the address to
// listen on: a socket file's directory must be private (checkSocketDir), so that no
// other local user can replace the socket and receive the plaintext DEK seeds.
func CheckListenAddr(endpoint string) (string, error) {
	if endpoint == "" {
		endpoint = DefaultListenAddr()
		if err := ensurePrivateDir(defaultSocketDir()); err != nil {
			return "", err
		}
	}
	addr, err := socketPath(endpoint)
	if err != nil {
		return "", err
	}
	if !strings.HasPrefix(addr, "@") {
		if err := checkSocketDir(filepath.Dir(addr)); err != nil {
			return "", err
		}
	}
	return addr, nil
}

// ListenUnix listens on addr, an address CheckListenAddr returned, replacing a stale
// socket file a previous run left behind.
func ListenUnix(addr string) (net.Listener, error) {
	if !strings.HasPrefix(addr, "@") {
		_ = os.Remove(addr)
	}
	lis, err := net.Listen("unix", addr)
	if err != nil {
		return nil, fmt.Errorf("kms-plugin: cannot listen on %s: %w", addr, err)
	}
	return lis, nil
}

// DefaultListenAddr is the gRPC socket used when Options.ListenAddr is empty: in
// $XDG_RUNTIME_DIR/rekey-kms when that is set, else in /tmp/rekey-kms-<uid>. A fixed
// path directly in /tmp could be created first by another local user, who would then
// receive every plaintext DEK seed the apiserver sends to be wrapped.
func DefaultListenAddr() string {
	return "unix://" + filepath.Join(defaultSocketDir(), "plugin.sock")
}

func defaultSocketDir() string {
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" && filepath.IsAbs(d) {
		return filepath.Join(d, "rekey-kms")
	}
	return filepath.Join(os.TempDir(), "rekey-kms-"+strconv.Itoa(os.Getuid()))
}

// ensurePrivateDir creates dir (mode 0700) if it does not exist; checkSocketDir then
// decides whether it may hold the socket.
func ensurePrivateDir(dir string) error {
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("kms-plugin: cannot create the socket directory %s: %w", dir, err)
	}
	return nil
}

// checkSocketDir refuses a socket directory that another local user could use to
// replace or intercept the socket: it must be a real directory (not a symlink), owned
// by this user (or root), and writable by no group or other user.
func checkSocketDir(dir string) error {
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("kms-plugin: socket directory: %w", err)
	}
	fix := "use a private directory (mkdir -m 0700) for --listen-addr, or an abstract socket unix:///@name"
	if fi.Mode()&fs.ModeSymlink != 0 {
		return fmt.Errorf("kms-plugin: socket directory %s is a symlink; %s", dir, fix)
	}
	if !fi.IsDir() {
		return fmt.Errorf("kms-plugin: socket directory %s is not a directory; %s", dir, fix)
	}
	if fi.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("kms-plugin: socket directory %s is writable by other users (mode %s), who could replace the socket and receive plaintext DEK seeds; %s", dir, fi.Mode().Perm(), fix)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		if uid := int(st.Uid); uid != os.Getuid() && uid != 0 {
			return fmt.Errorf("kms-plugin: socket directory %s belongs to uid %d, not to this user (uid %d) or root; %s", dir, uid, os.Getuid(), fix)
		}
	}
	return nil
}
