package main

import (
	"encoding/json"
	"fmt"
	"io"

	"github.com/spf13/pflag"
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

// write prints v as indented JSON, or renders the table.
func (o outputFormat) write(w io.Writer, v any, table func(io.Writer)) error {
	if o == outputJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
	table(w)
	return nil
}
