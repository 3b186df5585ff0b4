package snapshotfile

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime/debug"
	"runtime/metrics"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	bolt "go.etcd.io/bbolt"
)

// bbolt runs in a child process, the reader: validateBolt checks what bbolt touches,
// but a fault it did not foresee (bbolt follows unsafe pointers; see bolt.go) is a
// runtime fault, which no recover() catches and which would end rekey with a stack
// dump. In a child it ends the child: the parent sees the reader stop before its last
// frame and reports a corrupt snapshot, exit status 1. The reader also sets
// debug.SetPanicOnFault, so that most such faults become an error it reports itself,
// bounds its stack, so that runaway recursion ends fast, and watches itself: a page
// loop bbolt follows forever (its cursor then grows its stack of pages without end)
// ends the reader when its heap passes readerMaxHeap (a reader needs a few MiB: bbolt's
// pages are mapped, not copied) or when it makes no progress for readerStall.
//
// The reader writes frames to its standard output; the parent decodes them with
// bounds on every length:
//
//	'h' len protocol          first, before the database is opened
//	'p' len key len value     a revision key and its value, newest revision first
//	'e' len message           the read failed: the last frame
//	'd'                       the read is complete: the last frame
//
// len is a uvarint.
const (
	readerProtocol = "rekey-etcdsnapshot-reader/1"
	frameHello     = 'h'
	framePair      = 'p'
	frameError     = 'e'
	frameDone      = 'd'
	maxKeyFrame    = 64
	maxTextFrame   = 4096
	readerBuffer   = 256 << 10
	readerMaxStack = 64 << 20
	readerMaxHeap  = 1 << 30
	readerStall    = 30 * time.Second
	maxStderr      = 4096
)

// readerLimits bound a reader process.
type readerLimits struct {
	maxHeap uint64
	stall   time.Duration
	tick    time.Duration
}

// openTimeout bounds bbolt's wait for the lock of the private copy, which no other
// process holds.
const openTimeout = 5 * time.Second

// Reader makes the command of the reader process for the bbolt database at dbPath: a
// program that calls ServeReader(dbPath, its standard output). The parent sets the
// command's standard output, standard error and environment (Env nil is the parent's).
type Reader func(ctx context.Context, dbPath string) *exec.Cmd

// SelfReader is a Reader that runs this program's own binary with args and the
// database path: the program must call ServeReader(path, stdout) when run that way
// (rekey: a hidden subcommand).
func SelfReader(args ...string) Reader {
	return func(ctx context.Context, dbPath string) *exec.Cmd {
		exe, err := os.Executable()
		if err != nil {
			exe = os.Args[0]
		}
		return exec.CommandContext(ctx, exe, append(slices.Clone(args), dbPath)...)
	}
}

// ServeReader is the reader process: it reads the bbolt database at dbPath (a copy
// validateBolt accepted) and writes the frames of its key bucket to w. Its error is
// also sent as the last frame; the process should exit non-zero with it. It owns the
// process: it sets its stack limit, and exits it (status 3) when the read runs away.
func ServeReader(dbPath string, w io.Writer) error {
	return serveReader(dbPath, w, readerLimits{maxHeap: readerMaxHeap, stall: readerStall, tick: time.Second})
}

func serveReader(dbPath string, w io.Writer, limits readerLimits) error {
	debug.SetMaxStack(readerMaxStack)
	bw := bufio.NewWriterSize(w, readerBuffer)
	writeText(bw, frameHello, readerProtocol)
	// The hello goes out before bbolt touches the file: a reader that dies without it
	// did not start right, which is not the snapshot's fault.
	if err := bw.Flush(); err != nil {
		return err
	}
	var progress watchdog
	stop := make(chan struct{})
	defer close(stop)
	go progress.watch(limits, stop)
	err := readBolt(dbPath, func(k, v []byte) error {
		progress.steps.Add(1)
		progress.writing.Store(true) // a write blocked on a slow parent is not a stall
		_ = bw.WriteByte(framePair)
		writeBytes(bw, k)
		writeBytes(bw, v)
		progress.writing.Store(false)
		return nil
	})
	if err != nil {
		writeText(bw, frameError, err.Error())
	} else {
		_ = bw.WriteByte(frameDone)
	}
	if ferr := bw.Flush(); ferr != nil && err == nil {
		err = ferr
	}
	return err
}

// watchdog ends a reader that runs away: a heap past limits.maxHeap, or no pair for
// limits.stall outside writes.
type watchdog struct {
	steps   atomic.Uint64
	writing atomic.Bool
}

func (d *watchdog) watch(limits readerLimits, stop <-chan struct{}) {
	t := time.NewTicker(limits.tick)
	defer t.Stop()
	sample := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	last, since := d.steps.Load(), time.Now()
	for {
		select {
		case <-stop:
			return
		case now := <-t.C:
			metrics.Read(sample)
			if sample[0].Value.Kind() == metrics.KindUint64 && sample[0].Value.Uint64() > limits.maxHeap {
				die(fmt.Sprintf("the snapshot reader's heap passed %d MiB: bbolt is following a loop in the database's pages", limits.maxHeap>>20))
			}
			if s := d.steps.Load(); s != last || d.writing.Load() {
				last, since = s, now
			} else if now.Sub(since) > limits.stall {
				die(fmt.Sprintf("the snapshot reader made no progress for %s: bbolt is following a loop in the database's pages", limits.stall))
			}
		}
	}
}

// die ends the reader process the way a runtime fault does; the parent names the
// line.
func die(why string) {
	fmt.Fprintln(os.Stderr, "fatal error: "+why)
	os.Exit(3)
}

// readBolt calls pair with every element of the key bucket, newest revision first.
func readBolt(dbPath string, pair func(k, v []byte) error) (err error) {
	// SetPanicOnFault turns a fault of this goroutine at a non-nil address — bbolt
	// reading past its memory map — into a panic, which is recovered here.
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("bbolt failed reading it: %v", r)
		}
	}()
	db, err := bolt.Open(dbPath, 0o400, &bolt.Options{ReadOnly: true, Timeout: openTimeout})
	if err != nil {
		return fmt.Errorf("bbolt cannot open it: %w", err)
	}
	defer db.Close()
	return db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte(keyBucket))
		if b == nil {
			return errors.New(`it has no "key" bucket`)
		}
		c := b.Cursor()
		for k, v := c.Last(); k != nil; k, v = c.Prev() {
			if err := pair(k, v); err != nil {
				return err
			}
		}
		return nil
	})
}

func writeBytes(w *bufio.Writer, b []byte) {
	var n [binary.MaxVarintLen64]byte
	_, _ = w.Write(n[:binary.PutUvarint(n[:], uint64(len(b)))])
	_, _ = w.Write(b)
}

func writeText(w *bufio.Writer, tag byte, s string) {
	if len(s) > maxTextFrame {
		s = s[:maxTextFrame]
	}
	_ = w.WriteByte(tag)
	writeBytes(w, []byte(s))
}

// readerResult is what the parent made of the reader's frames.
type readerResult struct {
	hello    bool
	done     bool
	failure  string // the reader's error frame
	corrupt  string // frames the snapshot's content made impossible
	protocol string // frames no reader of this binary writes
	stop     error  // the pair callback's error
}

// decodeFrames reads the reader's frames from r, handing pairs to pair. budget bounds
// the bytes of all keys and values: a database holds each once, so a reader sending
// more than the database's size is reading garbage.
func decodeFrames(r *bufio.Reader, budget int64, pair func(k, v []byte) error) readerResult {
	var res readerResult
	for {
		tag, err := r.ReadByte()
		if err != nil {
			return res // ended without its last frame
		}
		switch {
		case tag == frameHello && !res.hello:
			s, err := readLen(r, maxTextFrame)
			if err != nil {
				return res
			}
			if string(s) != readerProtocol {
				res.protocol = fmt.Sprintf("it speaks %q, not %q", s, readerProtocol)
				return res
			}
			res.hello = true
		case !res.hello:
			res.protocol = fmt.Sprintf("its first frame is %q, not a hello", tag)
			return res
		case tag == framePair:
			klen, err := binary.ReadUvarint(r)
			if err != nil {
				return res
			}
			if klen > maxKeyFrame {
				res.corrupt = fmt.Sprintf("it has a revision key of %d bytes", klen)
				return res
			}
			k := make([]byte, klen)
			if _, err := io.ReadFull(r, k); err != nil {
				return res
			}
			vlen, err := binary.ReadUvarint(r)
			if err != nil {
				return res
			}
			if budget -= int64(klen); vlen > uint64(max(budget, 0)) {
				res.corrupt = "its key bucket holds more bytes than the whole file"
				return res
			}
			budget -= int64(vlen)
			v := make([]byte, vlen)
			if _, err := io.ReadFull(r, v); err != nil {
				return res
			}
			if err := pair(k, v); err != nil {
				res.stop = err
				return res
			}
		case tag == frameError:
			s, err := readLen(r, maxTextFrame)
			if err != nil {
				return res
			}
			res.failure = string(s)
			return res
		case tag == frameDone:
			res.done = true
			return res
		default:
			res.protocol = fmt.Sprintf("it sent a frame %q", tag)
			return res
		}
	}
}

func readLen(r *bufio.Reader, limit uint64) ([]byte, error) {
	n, err := binary.ReadUvarint(r)
	if err != nil {
		return nil, err
	}
	if n > limit {
		return nil, fmt.Errorf("a frame of %d bytes", n)
	}
	b := make([]byte, n)
	_, err = io.ReadFull(r, b)
	return b, err
}

// runReader runs the reader process on the private copy dbPath of the snapshot src and
// hands the pairs it sends to pair.
func runReader(ctx context.Context, src, dbPath string, budget int64, reader Reader, pair func(k, v []byte) error) error {
	childCtx, kill := context.WithCancel(ctx)
	defer kill()
	cmd := reader(childCtx, dbPath)
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	// A runtime fault prints its first lines only, which name it.
	cmd.Env = append(cmd.Env, "GOTRACEBACK=none")
	cmd.Stdin = nil
	stderr := &headBuffer{max: maxStderr}
	cmd.Stderr = stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting the snapshot reader process %s: %w", cmd.Path, err)
	}
	res := decodeFrames(bufio.NewReaderSize(stdout, readerBuffer), budget, pair)
	if res.stop != nil || res.corrupt != "" || res.protocol != "" {
		kill() // it may still be writing, and nothing reads it any more
	}
	waitErr := cmd.Wait()
	switch {
	case res.done && waitErr == nil:
		return nil
	case res.stop != nil:
		return res.stop
	case ctx.Err() != nil:
		return fmt.Errorf("reading snapshot %s: %w", src, ctx.Err())
	case res.protocol != "" || !res.hello:
		why := res.protocol
		if why == "" {
			why = describeExit(waitErr, stderr.String())
		}
		return fmt.Errorf("the snapshot reader process %s did not start reading (%s): is this binary intact?", cmd.Path, why)
	case res.failure != "":
		return &CorruptError{Path: src, Reason: res.failure + damaged}
	case res.corrupt != "":
		return &CorruptError{Path: src, Reason: res.corrupt + damaged}
	}
	return &CorruptError{Path: src, Reason: "reading its bbolt database crashed the reader process (" + describeExit(waitErr, stderr.String()) + ")" + damaged}
}

// describeExit names how a process ended: its exit status and what the Go runtime
// printed naming the fault (with GOTRACEBACK=none, no stack follows), else the first
// line of its standard error.
func describeExit(waitErr error, stderr string) string {
	what := "exit status 0"
	if waitErr != nil {
		what = waitErr.Error()
	}
	var named []string
	first := ""
	for l := range strings.SplitSeq(stderr, "\n") {
		l = strings.TrimSpace(l)
		if first == "" {
			first = l
		}
		for _, p := range []string{"fatal error:", "panic:", "unexpected fault address", "[signal "} {
			if strings.HasPrefix(l, p) && len(named) < 2 {
				named = append(named, l)
			}
		}
	}
	if len(named) == 0 && first != "" {
		named = []string{first}
	}
	if len(named) > 0 {
		what += ": " + strings.Join(named, "; ")
	}
	if len(what) > 300 {
		what = what[:300] + "…"
	}
	return what
}

// headBuffer keeps the first max bytes written to it.
type headBuffer struct {
	buf bytes.Buffer
	max int
}

func (b *headBuffer) Write(p []byte) (int, error) {
	if room := b.max - b.buf.Len(); room > 0 {
		b.buf.Write(p[:min(room, len(p))])
	}
	return len(p), nil
}

func (b *headBuffer) String() string { return b.buf.String() }
