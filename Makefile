# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint typecheck unit integration e2e bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, so nothing below can pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# Prebuild the native CPU kernels into the cache (a few seconds); never fatal.
	-$(BIN)/python -m inferd.models.kernels build
	touch $(STAMP)

# The server on http://0.0.0.0:8000 (gRPC :8001): inferd-tiny, the example model repository and
# the image model inferd-tiny-sd; ARGS="..." replaces those arguments.
serve: $(STAMP)
	$(BIN)/inferd serve $(or $(ARGS),inferd-tiny --model-repository examples --image-model inferd-tiny-sd)

lint: $(STAMP)
	$(BIN)/ruff check inferd tests bench
	$(BIN)/ruff format --check inferd tests bench
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

test: $(STAMP) lint typecheck
	$(BIN)/pytest -q -ra $(PYTEST_ARGS)

unit: $(STAMP)
	$(BIN)/pytest -q tests/unit

integration: $(STAMP)
	$(BIN)/pytest -q tests/integration

bench: $(STAMP)
	$(BIN)/python bench/offline_throughput.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
