#!/bin/sh
# Regenerates the Go code of the E2B envd protocol (api/e2b/*/*.proto) into
# internal/e2b/*pb. The output is committed: building or testing dsec
# needs none of this. Needs protoc (Debian: protobuf-compiler); the Go
# plugins are built from the versions go.mod names.
set -eu
cd "$(dirname "$0")/.."
command -v protoc >/dev/null || { echo "protoc is missing: apt-get install -y protobuf-compiler" >&2; exit 1; }
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
GOBIN=$bin go install google.golang.org/protobuf/cmd/protoc-gen-go
GOBIN=$bin go install connectrpc.com/connect/cmd/protoc-gen-connect-go
PATH=$bin:$PATH protoc -I api/e2b -I /usr/include \
	--go_out=. --go_opt=module=github.com/dsecproject/dsec \
	--connect-go_out=. --connect-go_opt=module=github.com/dsecproject/dsec \
	process/process.proto filesystem/filesystem.proto
echo "generated: $(find internal/e2b -name '*.go' | sort | tr '\n' ' ')"
