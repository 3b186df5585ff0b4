package progress

import (
	"bytes"
	"testing"
)

func TestFlagAcceptsOnlyOfferedModes(t *testing.T) {
	f := NewFlag(Auto, Bar, Plain)
	if f.Mode() != Auto || f.Type() != "auto|bar|plain" {
		t.Fatalf("default %q, type %q", f.Mode(), f.Type())
	}
	if err := f.Set("none"); err == nil || err.Error() != "use auto, bar or plain" {
		t.Fatalf("Set(none) = %v, want use auto, bar or plain", err)
	}
	if err := f.Set("lines"); err != nil || f.Mode() != Plain {
		t.Fatalf("Set(lines) = %v, mode %q; want the old spelling of plain", err, f.Mode())
	}
}

func TestWriterBarAndPlain(t *testing.T) {
	var b bytes.Buffer
	p := New(&b, Bar)
	p.Status("one", false)
	p.Status("skipped: too soon", false)
	p.Status("two", true)
	p.Line("event")
	p.Status("three", false)
	p.Done()
	if want := "\r\033[Kone\r\033[Ktwo\r\033[Kevent\n\r\033[Kthree\n"; b.String() != want {
		t.Fatalf("bar output %q, want %q", b.String(), want)
	}

	b.Reset()
	p = New(&b, Auto) // a buffer is no terminal
	if p.Mode() != Plain {
		t.Fatalf("auto on a buffer = %q, want plain", p.Mode())
	}
	p.Status("status", true)
	p.Line("event")
	p.Done()
	if b.String() != "event\n" {
		t.Fatalf("plain output %q, want the event line only", b.String())
	}

	b.Reset()
	p = New(&b, None)
	p.Line("event")
	if b.Len() != 0 {
		t.Fatalf("none printed %q", b.String())
	}
}

func TestFill(t *testing.T) {
	for frac, want := range map[float64]string{0: "[    ]", 0.5: "[==  ]", 1: "[====]", 2: "[====]", -1: "[    ]"} {
		if got := Fill(frac, 4); got != want {
			t.Errorf("Fill(%v) = %q, want %q", frac, got, want)
		}
	}
}
