# specfleet developer entry points. Everything installs into ./.venv in the repo root.
#   make demo   install, find or start Redis, run one worker on Gemma 3 270M, stream a batch
#   make test   install and run the whole test suite against a real Redis (CI runs this)
#   make test-fast  the same without the tests marked slow (worker fleets, gateways, Gemma):
#               the edit loop; tests/conftest.py marks them from what they use
#   make lint   ruff over the tree, mypy over shared, coordinator and worker
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# llama-cpp-python is a source build; keep the user's own CMAKE_ARGS (e.g. -DGGML_CUDA=on).
# GGML_RPC: llama.cpp's RPC backend, for workers over devices in other processes or hosts
# (--rpc, python -m worker.service.rpc_device; docs/fitter.md, "Device groups").
CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DGGML_RPC=ON
export CMAKE_ARGS

.PHONY: install demo test test-fast lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

# pip reuses a wheel it built before, whatever CMAKE_ARGS were then: a llama-cpp-python
# without the RPC backend asked for here is dropped from pip's cache and rebuilt from source
# (the new wheel is cached, so the next install reuses one with RPC).
HAS_RPC := import importlib.util as u, pathlib, sys; \
	d = pathlib.Path(u.find_spec("llama_cpp").submodule_search_locations[0]); \
	sys.exit(0 if list(d.glob("lib/libggml-rpc*")) else 1)
LLAMA_VERSION := import importlib.metadata as m; print(m.version("llama-cpp-python"))

# setup.py and the C source: the suffix drafter's native index is built by the install.
$(VENV)/.installed: pyproject.toml setup.py worker/engine/proposers/_lookup.c | $(PY)
	@echo "installing specfleet into $(VENV) (llama-cpp-python builds from source: ~5 min on 2 cores)"
	$(PIP) install -e '.[dev,demo]'
	@if echo "$(CMAKE_ARGS)" | grep -q 'GGML_RPC=ON' && ! $(PY) -c '$(HAS_RPC)'; then \
		echo "llama-cpp-python came from a wheel built without the RPC backend: rebuilding it"; \
		$(PIP) cache remove 'llama_cpp_python*' >/dev/null 2>&1 || true; \
		$(PIP) install --force-reinstall --no-deps \
			"llama-cpp-python==$$($(PY) -c '$(LLAMA_VERSION)')"; \
	fi
	@touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m coordinator.demo

# The suite runs in PYTEST_WORKERS processes, a test file to each (most of a test's time is
# spent waiting on worker processes, Redis backoffs and subprocess starts, not computing).
PYTEST_WORKERS ?= 3
PYTEST := $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

test: install
	$(PY) -m coordinator.redis_local -- $(PYTEST)

test-fast: install
	$(PY) -m coordinator.redis_local -- $(PYTEST) -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy shared coordinator worker

bench: install
	$(PY) bench/spec_vs_plain.py
	$(PY) bench/spec_sampling.py
	$(PY) bench/rollback_depth.py
	$(PY) bench/service_overhead.py
	$(PY) bench/prefix_reuse.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
