package migrate

import "github.com/rekey-io/rekey/pkg/transformers"

// ClassifyValue is the bucket of a stored value judged by its bytes alone, as an
// inventory without a configuration sees it: provider, key name and stored prefix,
// and a KMS v2 value's key id hash. KnownKey and Stale say nothing here.
func ClassifyValue(v []byte) Bucket { return newClassifier(transformers.RuleInfo{}, nil).classify(v) }
