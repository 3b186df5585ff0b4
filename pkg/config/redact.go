package config

import (
	"fmt"
	"regexp"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation/field"
)

// Redacted stands in for a value that validation would otherwise print. It renders as
// <redacted> through field.Error (whose fallback for values that do not marshal to
// JSON is String) and through every fmt verb.
type Redacted struct{}

// String implements fmt.Stringer.
func (Redacted) String() string { return "<redacted>" }

// GoString implements fmt.GoStringer so %#v does not show the type's insides either.
func (Redacted) GoString() string { return "<redacted>" }

// MarshalJSON fails on purpose: field.Error renders a bad value as JSON first and only
// falls back to String when that fails, and "<redacted>" must not be shown quoted as
// if it were the user's input.
func (Redacted) MarshalJSON() ([]byte, error) {
	return nil, fmt.Errorf("redacted value")
}

// safeBadValue reports whether the bad value at path may be shown. Only the resource
// names of a rule (`resources[i].resources[j]`) qualify: they are group/resource names,
// and seeing the bad one is what makes the error useful. Everything under providers can
// hold a secret — upstream renders a whole provider struct, keys included, when one list
// element names two providers — so nothing there is shown, and neither is anything this
// package does not know (new fields in later upstream versions).
var safeBadValuePath = regexp.MustCompile(`^resources\[\d+\]\.resources\[\d+\]$`)

func safeBadValue(e *field.Error) bool {
	if !safeBadValuePath.MatchString(e.Field) {
		return false
	}
	name, isString := e.BadValue.(string)
	return isString && !looksLikeKey(name)
}

// looksLikeKey reports whether s holds a run of 16 or more base64 characters with a
// digit, '+' or '/' in it: no resource name does, and a key pasted in the wrong place
// almost surely does.
func looksLikeKey(s string) bool {
	for _, run := range keyLike.FindAllString(s, -1) {
		if len(run) >= 16 {
			return true
		}
	}
	return false
}

// redactErrors rebuilds errs keeping each error's type, field path and detail, with the
// bad value replaced by Redacted unless it is known to be safe to show.
func redactErrors(errs field.ErrorList) field.ErrorList {
	out := make(field.ErrorList, 0, len(errs))
	for _, e := range errs {
		if e == nil {
			continue
		}
		c := *e
		if !safeBadValue(e) {
			c.BadValue = Redacted{}
		}
		out = append(out, &c)
	}
	return out
}

// Decode errors come from several parsers (YAML scanner, YAML→JSON conversion, JSON
// unmarshalling, the strict field checks) and many of them quote the offending input: a
// secret with a `!!int` tag, a null or complex map key with its value, an unknown field
// named after a pasted key. Only the shapes below are rebuilt from parts known to be
// harmless; anything else is reduced to its position.
var (
	// The YAML scanner and parser report fixed sentences of lower-case words.
	yamlSyntaxErr = regexp.MustCompile(`yaml: line (\d+): ([a-z][a-z ',:(){}\[\]-]*)$`)
	// A tagged scalar that does not parse as its tag: `!!int <the value>`.
	yamlTagErr = regexp.MustCompile(`cannot decode !!([a-z]+) .* as an? !!([a-z]+)`)
	// Map keys JSON cannot represent (null, lists, maps); the messages quote key and value.
	badMapKey = regexp.MustCompile(`unsupported map key of type|invalid map key`)
	// The scheme does not know the document's apiVersion/kind.
	notRegistered = regexp.MustCompile(`no kind "([^"]*)" is registered for version "([^"]*)"`)
	safeKind      = regexp.MustCompile(`^[A-Za-z]{1,64}$`)
	safeVersion   = regexp.MustCompile(`^(apiserver\.config\.k8s\.io/)?v[0-9]{1,3}((alpha|beta)[0-9]{1,3})?$`)
	// json.UnmarshalTypeError: a JSON kind, a Go field path and a Go type.
	jsonTypeErr = regexp.MustCompile(`json: cannot unmarshal (string|number|bool|array|object|null)(?: [^ ]+)? into Go (?:struct field [A-Za-z0-9_]+\.([A-Za-z0-9_.]+)|value) of type ([A-Za-z0-9_.\[\]*]+)`)
	// Strict decoding: unknown or duplicate field paths.
	strictFieldErr = regexp.MustCompile(`(unknown|duplicate) field "([^"]*)"`)
	// YAML duplicate keys: `line 7: key "secret" already set in map`.
	yamlDuplicateKey = regexp.MustCompile(`line (\d+): key "([^"]*)" already set in map`)
	lineNumber       = regexp.MustCompile(`line (\d+)`)
	pathSegment      = regexp.MustCompile(`^[A-Za-z]{1,20}(\[\d+\])?$`)
	// keyLike is a run of base64 characters long enough to be key material (base64 of
	// the shortest key, 16 bytes, has 24) that is not a plain word.
	keyLike = regexp.MustCompile(`[A-Za-z0-9+/]*[0-9+/][A-Za-z0-9+/]*`)
)

// safeFieldPath returns path if each of its dot-separated segments looks like a field
// name (letters only, at most 20 of them, with an optional [index]: every field of an
// EncryptionConfiguration is, and a pasted key practically never is),
// otherwise the longest such prefix followed by ".<redacted>".
func safeFieldPath(path string) string {
	segs := strings.Split(path, ".")
	for i, s := range segs {
		if !pathSegment.MatchString(s) {
			if i == 0 {
				return "<redacted>"
			}
			return strings.Join(segs[:i], ".") + ".<redacted>"
		}
	}
	return path
}

// DescribeDecodeError returns a message for an error of sigs.k8s.io/yaml or the
// apimachinery decoders that says where and what kind of problem it is without quoting
// the input; what names the expected document ("EncryptionConfiguration", "keys file").
// Other readers of files with key material (the test KMS plugin) use it too.
func DescribeDecodeError(err error, what string) string {
	msg := err.Error()
	if m := yamlSyntaxErr.FindStringSubmatch(msg); m != nil {
		return fmt.Sprintf("YAML syntax error at line %s: %s", m[1], m[2])
	}
	if m := yamlTagErr.FindStringSubmatch(msg); m != nil {
		return fmt.Sprintf("a value tagged !!%s is not a valid %s (remove the tag: names and secrets are strings)", m[2], m[2])
	}
	if badMapKey.MatchString(msg) {
		return withLine(msg, "a map key is null, a list or a map; every key must be a field name")
	}
	if m := notRegistered.FindStringSubmatch(msg); m != nil {
		kind, version := "<redacted>", "<redacted>"
		if safeKind.MatchString(m[1]) {
			kind = m[1]
		}
		if safeVersion.MatchString(m[2]) {
			version = m[2]
		}
		return fmt.Sprintf("no kind %q is registered for version %q (want apiVersion apiserver.config.k8s.io/v1, kind EncryptionConfiguration)", kind, version)
	}
	var parts []string
	for _, m := range yamlDuplicateKey.FindAllStringSubmatch(msg, -1) {
		parts = append(parts, fmt.Sprintf("line %s: key %q is set twice in one map", m[1], safeFieldPath(m[2])))
	}
	for _, m := range strictFieldErr.FindAllStringSubmatch(msg, -1) {
		parts = append(parts, fmt.Sprintf("%s field %q", m[1], safeFieldPath(m[2])))
	}
	for _, m := range jsonTypeErr.FindAllStringSubmatch(msg, -1) {
		where := "the document"
		if m[2] != "" {
			where = "field " + safeFieldPath(m[2])
		}
		parts = append(parts, fmt.Sprintf("%s must be of type %s, got a JSON %s", where, m[3], m[1]))
	}
	if len(parts) > 0 {
		out := strings.Join(parts, "; ")
		if strings.Contains(msg, "strict decoding error") {
			out = "strict decoding error: " + out
		}
		return out
	}
	// Not a shape known to be safe: keep the position only.
	generic := "not a well-formed " + what + " (check indentation, quoting, map keys and tags such as !!int on string fields; the parser's own message is withheld because it can quote key material)"
	return withLine(msg, generic)
}

// withLine prefixes description with the first line number msg mentions, if any.
func withLine(msg, description string) string {
	if m := lineNumber.FindStringSubmatch(msg); m != nil {
		return fmt.Sprintf("line %s: %s", m[1], description)
	}
	return description
}
