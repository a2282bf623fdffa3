# dsec — the two commands a newcomer runs:
#   make run    install what is missing, build, start `dsec up`, run the demo
#   make test   install what is missing, build, run every test (as root: all of them),
#               then each fuzz target for a few seconds

export PATH := /usr/local/go/bin:$(PATH)
GO ?= go
BIN := bin/dsec
STATE_DIR ?= /var/lib/dsec
LISTEN ?= 127.0.0.1:7070

.PHONY: all build deps deps-test run demo test test-unit vet fuzz bench soak clean

all: build

# Host packages dsec needs at run time (Debian names). Installed only when a
# binary is missing, so a prepared machine never touches the network.
deps:
	@./scripts/deps.sh

deps-test:
	@./scripts/deps.sh --test

# cgo stays on: the exec helper (internal/sandbox/container/nsexec) is C.
# The microVM guest's agent is static (the guest has no libc).
build:
	CGO_ENABLED=1 $(GO) build -o $(BIN) ./cmd/dsec
	CGO_ENABLED=0 $(GO) build -o bin/dsec-agent ./cmd/dsec-agent

run: deps build
	@STATE_DIR=$(STATE_DIR) LISTEN=$(LISTEN) DSEC=$(BIN) ./scripts/demo.sh

vet:
	$(GO) vet ./...
	@fmt=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$fmt" ]; then echo "gofmt needed: $$fmt"; exit 1; fi

# Unit tests only (fast; root-only tests skip with a reason when not root).
test-unit:
	$(GO) test -count=1 ./internal/... ./sdk/... ./api/... ./cmd/...

# Everything, including the end-to-end tests against a real `dsec up`, then
# a short run of every fuzz target (about a minute in all).
test: deps-test vet build
	$(GO) test -count=1 -timeout 30m ./...
	FUZZTIME=3s ./scripts/fuzz.sh

# Every fuzz target for FUZZTIME each, one after the other (scripts/fuzz.sh).
# The long run: make fuzz FUZZTIME=10m (about two hours for all of them).
FUZZTIME ?= 3s
fuzz:
	FUZZTIME=$(FUZZTIME) ./scripts/fuzz.sh

bench: build
	$(BIN) bench create --count 100 --concurrency 8 --state-dir $(STATE_DIR)
	$(BIN) bench exec --count 200 --concurrency 1 --state-dir $(STATE_DIR)
	$(BIN) bench pause --count 50 --concurrency 4
	$(BIN) bench snapshot --count 5
	$(BIN) bench fork --count 100
	$(BIN) bench pool --count 50
	$(BIN) bench envsetup --count 20 --concurrency 4 --state-dir $(STATE_DIR)
	$(BIN) bench density --count 1000 --concurrency 16 --state-dir $(STATE_DIR)

# About 18 minutes on the reference machine: not part of make bench.
soak: build
	$(BIN) bench soak --cycles 10000 --concurrency 8 --state-dir $(STATE_DIR)

clean:
	rm -rf bin
