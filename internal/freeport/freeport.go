// Package freeport picks loopback TCP ports for servers that are started a moment later
// (the process testbed, embedded etcd in tests and in the shim).
//
// It picks below the kernel's ephemeral port range on purpose: a port from
// 127.0.0.1:0 comes from that range, and between the pick and the server's bind any
// outgoing connection on the machine may take it as its local port. CI saw exactly that:
// an etcd member of a 3-member cluster failed with "bind: address already in use" while
// other test packages ran beside it.
package freeport

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
)

// below is where picks start; ports under it are often fixed services.
const below = 10000

// Pick returns a loopback TCP port that was free a moment ago, outside the ephemeral
// range when the kernel says where that is.
func Pick() (int, error) {
	hi := ephemeralLow()
	if hi-below >= 1000 {
		for range 200 {
			port := below + rand.IntN(hi-below)
			if free(port) {
				return port, nil
			}
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("no free loopback port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// PickN returns n distinct ports (see Pick).
func PickN(n int) ([]int, error) {
	var out []int
	for len(out) < n {
		p, err := Pick()
		if err != nil {
			return nil, err
		}
		if !contains(out, p) {
			out = append(out, p)
		}
	}
	return out, nil
}

func contains(ps []int, p int) bool {
	for _, q := range ps {
		if q == p {
			return true
		}
	}
	return false
}

func free(port int) bool {
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return false
	}
	_ = l.Close()
	return true
}

// ephemeralLow is the first port of the kernel's ephemeral range (Linux), or 32768,
// the usual default, when it cannot be read.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 32768
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 32768
	}
	lo, err := strconv.Atoi(f[0])
	if err != nil {
		return 32768
	}
	return lo
}
