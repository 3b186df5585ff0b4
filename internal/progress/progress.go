// Package progress is the one progress display of the rekey commands. On a terminal it
// keeps one status line redrawn in place and prints event lines above it; elsewhere (CI
// logs, pipes) it prints the event lines only, and the command adds a periodic line
// when one is due, so a log reads as a story. The commands decide what a line says; this
// package owns the terminal handling and the --progress flag.
//
//	mode := progress.NewFlag(progress.Auto, progress.Bar, progress.Plain)
//	fs.Var(mode, "progress", "auto, bar or plain")
//	…
//	p := progress.New(os.Stderr, mode.Mode())
//	p.Status("copying "+progress.Fill(0.5, 20), false)
//	p.Line("resource done")
//	p.Done()
package progress

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/term"
)

// Mode is how progress is shown.
type Mode string

const (
	// Auto is Bar on a terminal and Plain otherwise.
	Auto Mode = "auto"
	// Bar keeps one status line redrawn in place, event lines printed above it.
	Bar Mode = "bar"
	// Plain prints event lines (and the periodic lines the command adds) only.
	Plain Mode = "plain"
	// None prints nothing.
	None Mode = "none"
)

// linesAlias is the name `rekey migrate` gave Plain first; it stays accepted so
// existing scripts keep working.
const linesAlias = "lines"

// Flag is a --progress flag value (a pflag.Value) that accepts the modes a command
// offers.
type Flag struct {
	mode    Mode
	offered []Mode
}

// NewFlag returns a flag set to def that accepts def and offered.
func NewFlag(def Mode, offered ...Mode) *Flag {
	return &Flag{mode: def, offered: append([]Mode{def}, offered...)}
}

// Mode is the mode the flag was set to.
func (f *Flag) Mode() Mode { return f.mode }

func (f *Flag) String() string { return string(f.mode) }

// Type names the accepted values in the help text.
func (f *Flag) Type() string { return strings.Join(f.names(), "|") }

// Set accepts one of the offered modes.
func (f *Flag) Set(s string) error {
	m := Mode(s)
	if s == linesAlias {
		m = Plain
	}
	for _, o := range f.offered {
		if o == m {
			f.mode = m
			return nil
		}
	}
	names := f.names()
	return fmt.Errorf("use %s or %s", strings.Join(names[:len(names)-1], ", "), names[len(names)-1])
}

func (f *Flag) names() []string {
	var out []string
	for _, m := range []Mode{Auto, Bar, Plain, None} {
		for _, o := range f.offered {
			if o == m {
				out = append(out, string(m))
				break
			}
		}
	}
	return out
}

// IsTerminal reports whether w is a terminal (where a line can be redrawn in place).
func IsTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// minRedraw bounds how often the status line is redrawn: faster is flicker.
const minRedraw = 100 * time.Millisecond

// eraseLine returns the cursor to the start of the line and erases it.
const eraseLine = "\r\033[K"

// Writer shows progress on one writer. It is safe for concurrent use (a migration
// reports progress from its workers).
type Writer struct {
	mu       sync.Mutex
	w        io.Writer
	mode     Mode
	drawn    bool
	lastDraw time.Time
	lastLine time.Time
}

// New returns a Writer on w; Auto becomes Bar when w is a terminal, Plain otherwise.
func New(w io.Writer, m Mode) *Writer {
	if m == Auto {
		m = Plain
		if IsTerminal(w) {
			m = Bar
		}
	}
	return &Writer{w: w, mode: m}
}

// Mode is the mode in effect (never Auto).
func (p *Writer) Mode() Mode { return p.mode }

// Line prints one event line: above the status line in Bar mode, nothing in None.
func (p *Writer) Line(s string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mode == None {
		return
	}
	p.clear()
	fmt.Fprintln(p.w, s)
	p.lastLine = time.Now()
}

// SinceLine is how long ago the last event line was printed (since the Writer was
// made when none was): commands print a periodic Plain line when it grows long.
func (p *Writer) SinceLine() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.lastLine.IsZero() {
		return time.Duration(1<<63 - 1)
	}
	return time.Since(p.lastLine)
}

// Status redraws the status line in Bar mode (nothing otherwise), at most every 100 ms
// unless force (a final state that must be seen).
func (p *Writer) Status(s string, force bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mode != Bar {
		return
	}
	now := time.Now()
	if p.drawn && !force && now.Sub(p.lastDraw) < minRedraw {
		return
	}
	fmt.Fprint(p.w, eraseLine+s)
	p.drawn, p.lastDraw = true, now
}

// Done ends the status line, leaving its last state visible, so what is printed next
// starts on a line of its own.
func (p *Writer) Done() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.drawn {
		fmt.Fprintln(p.w)
		p.drawn = false
	}
}

func (p *Writer) clear() {
	if p.drawn {
		fmt.Fprint(p.w, eraseLine)
		p.drawn = false
	}
}

// Fill renders frac (clamped to [0, 1]) as a bar of width cells: "[=====     ]".
func Fill(frac float64, width int) string {
	frac = min(max(frac, 0), 1)
	n := int(frac * float64(width))
	return "[" + strings.Repeat("=", n) + strings.Repeat(" ", width-n) + "]"
}
