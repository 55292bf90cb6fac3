# Two commands for a fresh machine:  make demo  |  make test
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test bench lint typecheck unit unit-sglang clean lock

$(BIN)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit("kvgate needs Python >= 3.11, found " + sys.version.split()[0]) if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

demo: $(BIN)/.installed
	$(BIN)/kvgate demo

bench: $(BIN)/.installed
	$(BIN)/kvgate bench mooncake --out bench-out

lint: $(BIN)/.installed
	$(BIN)/ruff check kvgate tests

typecheck: $(BIN)/.installed
	$(BIN)/mypy

unit: $(BIN)/.installed
	$(BIN)/pytest -q

# The gateway suites again with simulated SGLang workers (their hashes, events, radix cache and server).
unit-sglang: $(BIN)/.installed
	KVGATE_TEST_SIM_ENGINE=sglang $(BIN)/pytest -q tests/test_gateway.py tests/test_gateway_precise.py \
		tests/test_gateway_history.py tests/test_gateway_tiering.py

# Every part runs even when one fails (a failed lint must not hide the suite's result); the exit code
# and the last line say which failed. scripts/test-deps.sh first: Redis, Prometheus, dnsmasq.
TEST_PARTS := lint typecheck unit unit-sglang
test: $(BIN)/.installed
	@./scripts/test-deps.sh
	@failed=""; for part in $(TEST_PARTS); do \
		echo "== make $$part"; $(MAKE) --no-print-directory $(foreach f,$(MAKEFILE_LIST),-f $(f)) $$part || failed="$$failed $$part"; \
	done; \
	if [ -n "$$failed" ]; then echo "make test: FAILED:$$failed (of $(TEST_PARTS))" >&2; exit 1; fi; \
	echo "make test: all passed ($(TEST_PARTS))"

# deploy/constraints.txt: the runtime's exact dependency set (the image and tests/deploy/test_wheel.py
# install it). Regenerate after changing the dependencies in pyproject.toml.
lock:
	@tmp=$$(mktemp -d) && $(PYTHON) -m venv $$tmp/venv && \
	$$tmp/venv/bin/pip install -q --only-binary=:all: . && \
	{ grep '^#' deploy/constraints.txt; $$tmp/venv/bin/pip freeze --exclude kvgate; } > $$tmp/constraints.txt && \
	mv $$tmp/constraints.txt deploy/constraints.txt && rm -rf $$tmp && echo "deploy/constraints.txt updated"

# .venv-tools/: docker-compose and helm-sdkpy, built by the deploy tests on first use.
clean:
	rm -rf $(VENV) .venv-tools .mypy_cache .pytest_cache .ruff_cache
