// Command etcd is the etcd server, built from the module proxy at the
// go.etcd.io/etcd/server/v3 version in go.mod. `go install go.etcd.io/etcd/server/v3`
// refuses to build (etcd's go.mod has replace directives), but a main package
// around etcdmain inside this module builds with the usual flags and behaviour.
// The testbed uses it to run etcd as a separate process.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
