// Package errtext turns errors and text read from elsewhere into something that is safe
// to publish and print: bounded in size, and free of control characters.
//
// An error that reaches a status document or a member record in etcd must stay small: a
// large broken configuration (tens of thousands of validation errors) or a KMS plugin
// that answers with megabytes of text would otherwise make a member record too large
// for etcd, and a member that cannot publish disappears from every other apiserver's
// view while it keeps serving.
package errtext

import (
	"errors"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// MaxPublished is the size, in bytes, an error is cut to before it is published.
const MaxPublished = 1024

// Bounded returns err's text cut to at most max bytes, followed by a note of what was
// left out. An error that joins several (errors.Join, an aggregate of validation
// errors) keeps as many whole errors as fit and ends with "(N more errors)"; a single
// long error is cut at a character boundary and ends with "(M more bytes)". nil gives "".
func Bounded(err error, max int) string {
	if err == nil {
		return ""
	}
	if list := flatten(err); len(list) > 1 {
		return boundedList(list, max)
	}
	return BoundedText(err.Error(), max)
}

// BoundedText cuts s to at most max bytes (at a character boundary) followed by
// " … (M more bytes)".
func BoundedText(s string, max int) string {
	if len(s) <= max {
		return s
	}
	cut := max
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return fmt.Sprintf("%s … (%d more bytes)", s[:cut], len(s)-cut)
}

func boundedList(list []string, max int) string {
	var b strings.Builder
	kept := 0
	for _, e := range list {
		sep := ""
		if kept > 0 {
			sep = "; "
		}
		if b.Len()+len(sep)+len(e) > max {
			break
		}
		b.WriteString(sep + e)
		kept++
	}
	if kept == 0 { // even the first error is too long: cut it
		return BoundedText(list[0], max) + fmt.Sprintf(" (%d more errors)", len(list)-1)
	}
	if kept < len(list) {
		fmt.Fprintf(&b, " (%d more errors)", len(list)-kept)
	}
	return b.String()
}

// flatten lists the errors err joins: errors.Join and other Unwrap() []error, and
// Kubernetes' aggregates (Errors() []error). A wrapped aggregate keeps its wrapper's
// words on the first entry.
func flatten(err error) []string {
	var list []error
	switch e := err.(type) {
	case interface{ Unwrap() []error }:
		list = e.Unwrap()
	case interface{ Errors() []error }:
		list = e.Errors()
	default:
		var agg interface{ Errors() []error }
		if errors.As(err, &agg) {
			inner := agg.(error).Error()
			if outer, ok := strings.CutSuffix(err.Error(), inner); ok {
				out := flattenErrs(agg.Errors())
				if len(out) > 0 {
					out[0] = outer + out[0]
				}
				return out
			}
		}
		return []string{err.Error()}
	}
	return flattenErrs(list)
}

func flattenErrs(list []error) []string {
	out := make([]string, 0, len(list))
	for _, e := range list {
		if e != nil {
			out = append(out, e.Error())
		}
	}
	return out
}

// Printable replaces every control character in s (newlines and tabs included) and
// every invalid UTF-8 byte with U+FFFD, so that text read from etcd or a plugin cannot move the cursor, clear
// the screen or forge lines in a terminal or a log.
func Printable(s string) string {
	clean := true
	for _, r := range s {
		if unicode.IsControl(r) || r == utf8.RuneError {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	return strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return utf8.RuneError
		}
		return r
	}, s)
}
