// Package bench is the side-by-side benchmark harness behind `rekey-bench` and
// `make bench`: every scenario measures rekey and a baseline (upstream k8s.io/apiserver,
// or raw AES-GCM) in the same process and run, alternating, and reports medians, spread
// and ratios against the targets the issues set. A missed target is printed as missed.
//
// The files keep three layers apart, each depending only on the ones before it:
//
//   - helpers: the timing loop and op cases (measure.go), statistics (stats.go), the
//     result rows and targets (results.go, targets.go), number formatting (format.go),
//     and what several scenarios share to set up (configs.go, pairs.go, rawgcm.go,
//     kmsplugin.go, load.go, plots.go, confighash.go, rewrite.go; processrun.go: the
//     build, etcd process, client and plugin process of a scenario's bed, startBed;
//     hostedbed.go and rotation_clients.go: the three-apiserver testbed, its clients'
//     latencies and their rows, shared by the rotation and controller scenarios);
//   - scenarios: one file per scenario (rotation, controller and scale: one per side or
//     part, plus their testbeds), each returning rows and depending only on helpers;
//     scenarios.go lists them;
//   - rendering: report.go (the run's record, JSON and markdown) and chart.go (SVG and
//     PNG charts), which read rows and never measure.
//
// layout_test.go holds every file to these layers.
package bench
