package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"unicode"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/rekey-io/rekey/internal/errtext"
)

// outputFormat is the -o flag of every command that prints a report: table for people,
// json for programs. As a pflag.Value it refuses any other value when the flags are
// parsed.
type outputFormat string

const (
	outputTable outputFormat = "table"
	outputJSON  outputFormat = "json"
)

func (o *outputFormat) String() string { return string(*o) }

func (o *outputFormat) Type() string { return "table|json" }

func (o *outputFormat) Set(s string) error {
	switch f := outputFormat(s); f {
	case outputTable, outputJSON:
		*o = f
		return nil
	}
	return fmt.Errorf("use table or json")
}

// addOutputFlag adds -o/--output, table by default.
func addOutputFlag(fs *pflag.FlagSet, o *outputFormat) {
	*o = outputTable
	fs.VarP(o, "output", "o", "Output format: table or json.")
}

// row writes one table row: every cell made printable (errtext.Printable), so text read
// from etcd or a plugin can neither move the cursor nor break the table with a tab or a
// newline of its own.
func row(w io.Writer, cells ...string) {
	for i, c := range cells {
		cells[i] = errtext.Printable(c)
	}
	fmt.Fprintln(w, strings.Join(cells, "\t"))
}

// printLine writes one line of text that holds something read from etcd or a plugin,
// made printable.
func printLine(w io.Writer, format string, args ...any) {
	fmt.Fprintln(w, errtext.Printable(fmt.Sprintf(format, args...)))
}

// write prints v as indented JSON, or renders the table.
func (o outputFormat) write(w io.Writer, v any, table func(io.Writer)) error {
	if o == outputJSON {
		var b bytes.Buffer
		enc := json.NewEncoder(&b)
		enc.SetIndent("", "  ")
		if err := enc.Encode(v); err != nil {
			return err
		}
		_, err := w.Write(escapeC1(b.Bytes()))
		return err
	}
	table(w)
	return nil
}

// isC1 reports DEL and the C1 control characters (U+0080 to U+009F, CSI among them):
// the control characters encoding/json leaves as they are.
func isC1(r rune) bool { return r >= 0x7f && unicode.IsControl(r) }

// escapeC1 writes the C1 controls of a JSON document as \u escapes. They can only be
// inside its strings, so the document means the same, and a terminal that acts on C1
// controls gets none from text read from etcd.
func escapeC1(doc []byte) []byte {
	if !bytes.ContainsFunc(doc, isC1) {
		return doc
	}
	var b bytes.Buffer
	for _, r := range string(doc) {
		if isC1(r) {
			fmt.Fprintf(&b, `\u%04x`, r)
			continue
		}
		b.WriteRune(r)
	}
	return b.Bytes()
}

// printableErrors makes the error of every subcommand of root (at any depth) printable line by line
// (errtext.Printable): errors carry text read from etcd and from KMS plugins, and klog
// prints an error of several lines as it is. The line breaks between the items of a
// list rekey reports stay; errors.Is and errors.As still see the original error.
func printableErrors(root *cobra.Command) {
	for _, c := range root.Commands() {
		if run := c.RunE; run != nil {
			c.RunE = func(cmd *cobra.Command, args []string) error { return printableError(run(cmd, args)) }
		}
		printableErrors(c)
	}
}

func printableError(err error) error {
	if err == nil {
		return nil
	}
	lines := strings.Split(err.Error(), "\n")
	for i, l := range lines {
		lines[i] = errtext.Printable(l)
	}
	if text := strings.Join(lines, "\n"); text != err.Error() {
		return &printedError{err: err, text: text}
	}
	return err
}

// printedError is an error as printableError shows it.
type printedError struct {
	err  error
	text string
}

func (e *printedError) Error() string { return e.text }
func (e *printedError) Unwrap() error { return e.err }
