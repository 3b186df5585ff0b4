package kmsplugin

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"os"
	"strings"
	"time"
)

// DecodeFaults reads a faults document (JSON, every field optional), refusing unknown
// fields: a misspelt fault must not pass as a healthy plugin. The control API's PUT and
// the plugin binary's --faults both read it so.
func DecodeFaults(r io.Reader) (Faults, error) {
	var f Faults
	dec := json.NewDecoder(r)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		return Faults{}, err
	}
	return f, nil
}

// The control API (JSON over HTTP):
//
//	GET    /faults   the active Faults
//	PUT    /faults   replace them (body: Faults)
//	DELETE /faults   back to healthy
//	GET    /stats    call counts
//
// Requests that change faults must say Content-Type: application/json, and on a TCP
// address the Host header must name a loopback host: a web page can make a browser
// send a cross-site "simple" POST (form or text/plain body) to 127.0.0.1, and a DNS
// rebinding attack points a name the page controls at 127.0.0.1; neither passes both
// checks.
type controlServer struct {
	srv  *http.Server
	lis  net.Listener
	addr string
	path string
}

func startControl(addr string, p *Plugin) (*controlServer, error) {
	var lis net.Listener
	var err error
	c := &controlServer{}
	if rest, ok := strings.CutPrefix(addr, "unix://"); ok {
		path := rest
		if strings.HasPrefix(rest, "/@") {
			path = rest[1:]
		} else {
			_ = os.Remove(path)
			c.path = path
		}
		lis, err = net.Listen("unix", path)
	} else {
		host, _, splitErr := net.SplitHostPort(addr)
		if splitErr != nil {
			return nil, fmt.Errorf("kms-plugin: control address %q: %v (use unix:///path.sock or 127.0.0.1:port)", addr, splitErr)
		}
		if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
			return nil, fmt.Errorf("kms-plugin: control address %q is not loopback; faults can only be injected locally", addr)
		}
		lis, err = net.Listen("tcp", addr)
	}
	if err != nil {
		return nil, fmt.Errorf("kms-plugin: cannot listen for control on %s: %w", addr, err)
	}
	c.lis = lis
	c.addr = addr
	if lis.Addr().Network() == "tcp" {
		c.addr = lis.Addr().String()
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/faults", func(w http.ResponseWriter, r *http.Request) {
		switch r.Method {
		case http.MethodGet:
		case http.MethodPut, http.MethodPost:
			f, err := DecodeFaults(http.MaxBytesReader(w, r.Body, 1<<20))
			if err != nil {
				http.Error(w, "bad faults document: "+err.Error(), http.StatusBadRequest)
				return
			}
			p.SetFaults(f)
		case http.MethodDelete:
			p.SetFaults(Faults{})
		default:
			http.Error(w, "use GET, PUT or DELETE", http.StatusMethodNotAllowed)
			return
		}
		writeJSON(w, p.Faults())
	})
	mux.HandleFunc("/stats", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, p.Stats()) })
	c.srv = &http.Server{Handler: guardControl(mux, lis.Addr().Network() == "tcp"), ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := c.srv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			fmt.Fprintf(os.Stderr, "kms-plugin: control server: %v\n", err)
		}
	}()
	return c, nil
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

func (c *controlServer) close() {
	_ = c.srv.Close()
	if c.path != "" {
		_ = os.Remove(c.path)
	}
}

// guardControl refuses requests a browser could be tricked into sending: on TCP, a Host
// that is not loopback (DNS rebinding); everywhere, a state-changing request whose body
// is not declared JSON (cross-site form posts cannot set that type without a CORS
// preflight, which this server never grants).
func guardControl(next http.Handler, checkHost bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if checkHost && !loopbackHost(r.Host) {
			http.Error(w, fmt.Sprintf("Host %q is not a loopback name (localhost, 127.0.0.0/8, [::1]); the control API only answers local clients", r.Host), http.StatusForbidden)
			return
		}
		switch r.Method {
		case http.MethodGet, http.MethodHead:
		default:
			mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
			if err != nil || mt != "application/json" {
				http.Error(w, "state-changing requests must send Content-Type: application/json (curl -H 'Content-Type: application/json')", http.StatusUnsupportedMediaType)
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

// loopbackHost reports whether a Host header names the local machine: localhost, an
// address in 127.0.0.0/8 or ::1, each with an optional port.
func loopbackHost(hostport string) bool {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	} else if strings.HasPrefix(hostport, "[") && strings.HasSuffix(hostport, "]") {
		host = hostport[1 : len(hostport)-1]
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
