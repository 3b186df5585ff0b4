// Package monitoring holds rekey's monitoring pack (Prometheus alerting rules and a
// Grafana dashboard, see docs/monitoring.md) and its test. It is a Go module of its own
// so that the test can use Prometheus' rule and PromQL parsers without adding the
// Prometheus module to rekey's go.mod.
package monitoring
